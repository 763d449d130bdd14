"""Test support, one copy each, imported as `from tests.support.<module> import ...`:

- `launch`: torchrun launches of a worker script, spawned gloo groups, free ports (the command
  line and port picker are megagrpo.cli's, so the launcher, tests and benchmarks share them);
- `tiny`: tiny random HF checkpoints (Llama, Qwen2/3, MoE) built from config classes;
- `cli`: `python -m megagrpo ...` as a subprocess;
- `dispatch`: TorchDispatchModes that watch the ops a call runs (tensor sizes, matmul counts).

Worker scripts that torchrun starts run as `__main__` files: `launch.worker_env` puts the
repository root first on PYTHONPATH so that they import `tests.support` the same way.
"""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository root (the folder holding megagrpo/, kernels/ and tests/)."""
