"""Test-wide settings. TRITON_INTERPRET must be set before anything imports triton (Triton
reads it when @triton.jit decorates), so it is set here, at the very top of the session.
Subprocess launches (torchrun, multiprocessing) inherit it."""
import importlib
import os
from pathlib import Path
from typing import Any

import pytest

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


# Megatron-only workers (no vLLM: its engine cannot be rebuilt in a process) of these modules
# run in one launch per rank count, in this order: one start of the ranks (interpreter, torch,
# megatron-core, transformers) instead of one per module. Each module's `shared_job(work)`
# writes its worker's inputs under `work` and returns the worker's command line and what its
# fixture needs afterwards; the fixture reads `shared_launch[__name__]`, and its worker's
# output with `tests.support.launch.shared_output(work, nproc)`. A worker that must patch a
# library before megagrpo is imported (tests/_layout_resume_worker.py's full disk) keeps a
# launch of its own. The fused output
# worker is last of its launch: it shrinks the fused kernels' chunk constants for the rest of
# its process.
SHARED_LAUNCHES = {
    4: ("tests.test_context_parallel", "tests.test_foundation", "tests.test_moe",
        "tests.test_plan", "tests.test_seqpar", "tests.test_fused_output_layer"),
    2: ("tests.test_attention", "tests.test_lora", "tests.test_param_specs", "tests.test_vlm"),
}


class SharedLaunches:
    """Module name -> (its work folder, what its `shared_job` returned besides the command
    line). The first module asking starts its launch, with the workers of those modules of its
    group that have a test selected in this session."""

    def __init__(self, selected: set[str], tmp_path_factory: pytest.TempPathFactory) -> None:
        self.selected, self.tmp = selected, tmp_path_factory
        self.done: dict[str, tuple[Path, Any]] = {}
        self.failed: dict[int, str] = {}

    def __getitem__(self, module: str) -> tuple[Path, Any]:
        if module not in self.done:
            nproc = next(n for n, group in SHARED_LAUNCHES.items() if module in group)
            if nproc in self.failed:  # reported once in full; not launched again
                raise RuntimeError(f"the shared {nproc}-rank launch failed: "
                                   f"{self.failed[nproc][-2000:]}")
            try:
                self._launch(nproc, [m for m in SHARED_LAUNCHES[nproc]
                                     if m in self.selected or m == module])
            except Exception as e:
                self.failed[nproc] = str(e)
                raise
        return self.done[module]

    def _launch(self, nproc: int, modules: list[str]) -> None:
        from tests.support.launch import SHARED_LOG, run_jobs

        jobs, done = [], {}
        for name in modules:
            work = self.tmp.mktemp(name.rsplit(".", 1)[1])
            argv, state = importlib.import_module(name).shared_job(work)
            jobs.append((argv, work / SHARED_LOG))
            done[name] = (work, state)
        run_jobs(jobs, nproc, timeout=600 * len(jobs))
        self.done.update(done)


@pytest.fixture(scope="session")
def shared_launch(request, tmp_path_factory) -> SharedLaunches:
    """The launches of SHARED_LAUNCHES, each started by the first module that needs it."""
    selected = {item.module.__name__ for item in request.session.items
                if getattr(item, "module", None) is not None}
    return SharedLaunches(selected, tmp_path_factory)
