"""Moved to tests.support.launch; this name stays for test files written against it (other
branches of the same change). Import from tests.support.launch."""
from tests.support.launch import free_port, torchrun

__all__ = ["free_port", "torchrun"]
