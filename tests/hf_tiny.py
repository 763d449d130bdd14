"""Moved to tests.support.tiny; this name stays for test files written against it (other
branches of the same change). Import from tests.support.tiny."""
from tests.support.tiny import (
    LLAMA3_ROPE,
    load_dir,
    tiny_llama,
    tiny_llama31,
    tiny_qwen2,
    tiny_qwen2_moe,
    tiny_qwen3,
    tiny_qwen3_moe,
)

__all__ = ["LLAMA3_ROPE", "load_dir", "tiny_llama", "tiny_llama31", "tiny_qwen2",
           "tiny_qwen2_moe", "tiny_qwen3", "tiny_qwen3_moe"]
