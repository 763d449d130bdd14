"""Test support, one copy each, imported as `from tests.support.<module> import ...`:

- `launch`: a worker script on local ranks, started as torchrun starts them but without its
  agent (`run_ranks`, `run_ranks_results`, and in the worker `worker_args` and
  `write_results`), several workers in turn in one launch (`run_jobs`, tests/conftest.py's
  shared launches), spawned gloo groups (`spawn_ranks`, `gloo_rank`), collective counting,
  free ports (the command line and port picker are megagrpo.cli's, so the launcher, tests and
  benchmarks share them: no fixed ports);
- `tiny`: tiny random HF checkpoints (Llama, Qwen2/3, MoE) built from config classes, and
  `perturbed` copies of a model;
- `megatron`: a megatron-core model trained by hand on a worker's ranks (DDP and optimizer,
  a backward over a batch's rows);
- `bench`: benchmarks/ scripts imported by file path;
- `cli`: `python -m megagrpo ...` as a subprocess;
- `dispatch`: TorchDispatchModes that watch the ops a call runs (tensor sizes, matmul counts);
- `docs`: generated tables in the docs compared between their markers;
- `site/sitecustomize.py`: not a module of the package but a folder tests/conftest.py puts on
  PYTHONPATH, so that every child process skips the final garbage collections at its exit.

Worker scripts that `run_ranks` starts run as `__main__` files: `child_env` puts the repository
root first on PYTHONPATH so that they import `tests.support` the same way.
"""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository root (the folder holding megagrpo/, kernels/ and tests/)."""


def child_env(**changes: str | None) -> dict[str, str]:
    """This environment for a child process: the repository root first on PYTHONPATH and no
    TRITON_INTERPRET (the test session's setting for in-process kernels; a child picks its
    kernel path itself and the interpreter would only slow vLLM down); `changes` set
    variables, None removes one."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT),
                                                       os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env
