"""Test-wide settings. TRITON_INTERPRET must be set before anything imports triton (Triton
reads it when @triton.jit decorates), so it is set here, at the very top of the session.
Subprocess launches (torchrun, multiprocessing) inherit it."""
import os
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# every child process (a worker run as a __main__ file, a CLI run) imports `tests.support` and
# this checkout's `megagrpo` from the repository root, installed or not, and skips the final
# garbage collections of its torch / megatron / vLLM objects at exit
# (tests/support/site/sitecustomize.py: 1-1.5 s of CPU a process)
_ROOT = str(Path(__file__).resolve().parents[1])
_SITE = str(Path(__file__).resolve().parent / "support" / "site")
for _path in (_SITE, _ROOT):
    if _path not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (_path, os.environ.get("PYTHONPATH")) if p)
