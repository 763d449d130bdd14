"""Starting ranks for tests: torchrun launches of a worker script (real processes over gloo)
and torch.multiprocessing spawns of an importable worker function."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megagrpo.cli import free_port, torchrun_command
from tests.support import child_env

__all__ = ["count_collectives", "free_port", "gloo_rank", "save_rank", "spawn_ranks",
           "torchrun", "torchrun_command", "torchrun_results", "worker_env", "write_results"]


def worker_env(**changes: str | None) -> dict[str, str]:
    """`child_env` for a launched worker: one OpenMP thread per rank and unbuffered output (a
    worker runs as a `__main__` file and imports `tests.support` from the root on
    PYTHONPATH)."""
    return child_env(**{"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **changes})


def torchrun(script: str | Path, nproc: int, *args: str, timeout: int = 600,
             env: dict[str, str] | None = None) -> str:
    """Runs `script` on `nproc` local ranks (env: `worker_env()` unless given); returns the
    ranks' output, or raises with its tail when torchrun fails."""
    cmd = torchrun_command(nproc, str(script), *args)
    p = subprocess.run(cmd, env=env or worker_env(), capture_output=True, text=True,
                       timeout=timeout)
    out = p.stdout + p.stderr
    if p.returncode != 0:
        raise RuntimeError(f"torchrun {script} failed (rc={p.returncode}):\n{out[-8000:]}")
    return out


def torchrun_results(script: str | Path, nproc: int, work: Path, *args: str,
                     timeout: int = 600) -> Any:
    """`torchrun` of a worker that takes `--work WORK` and ends with `write_results`; returns
    what it wrote (WORK/results.json)."""
    torchrun(script, nproc, "--work", str(work), *args, timeout=timeout)
    return json.loads((work / "results.json").read_text())


def alive(pid: int) -> bool:
    """Whether process `pid` still runs: it exists and is not a zombie (killed, not reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def worker_args(**options: str) -> argparse.Namespace:
    """In a torchrun worker: its command line parsed, `--work WORK` (required) and one
    `--NAME` string option per keyword (`layouts="1x1,2x1"`: `--layouts`, that default); then
    one intra-op thread per rank (the ranks share the cores)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    for name, default in options.items():
        ap.add_argument(f"--{name}", default=default)
    args = ap.parse_args()
    torch.set_num_threads(1)
    return args


def write_results(results: Any, work: str | Path, *, flat: bool = False) -> None:
    """In a torchrun worker, on every rank: the ranks' `results` gathered, and rank 0 writes
    them to WORK/results.json (a list in rank order; with `flat`, the ranks' lists joined);
    every rank returns once the file is there."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        out = [r for rs in gathered for r in rs] if flat else gathered
        Path(work, "results.json").write_text(json.dumps(out))
    dist.barrier()


# ------------------------------------------------------------------ spawned gloo groups
@contextmanager
def gloo_rank(rank: int, world: int, rdzv: str) -> Iterator[dist.ProcessGroup]:
    """Inside a spawned rank: one intra-op thread (ranks share the cores) and a gloo group
    that rendezvous through the file `rdzv`; destroyed on the way out, even on an error."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def save_rank(results: Any, out_dir: str, rank: int) -> None:
    """A spawned rank's results, for `spawn_ranks` to load in the parent."""
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def spawn_ranks(worker: Callable[..., None], world: int, payload: Any,
                tmp_path: Path) -> list[Any]:
    """Saves `payload` under `tmp_path`, runs `worker(rank, world, rdzv, payload_path,
    out_dir)` on `world` spawned processes (a module-level function: spawn pickles it) and
    returns each rank's `save_rank` results, rank order."""
    payload_path = tmp_path / "payload.pt"
    torch.save(payload, payload_path)
    mp.spawn(worker, args=(world, str(tmp_path / "rdzv"), str(payload_path), str(tmp_path)),
             nprocs=world)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _counted(*args: Any, _fn: Callable[..., Any], _calls: list[int], **kwargs: Any) -> Any:
    _calls[0] += 1
    return _fn(*args, **kwargs)


def count_collectives() -> list[int]:
    """In a spawned rank: wraps the collectives the kernels could use in this process; returns
    a one-element call counter (read it before and after a call)."""
    calls = [0]
    for name in ("all_gather_single", "all_gather_into_tensor", "all_reduce", "all_gather"):
        fn = getattr(dist, name, None)
        if fn is not None:
            setattr(dist, name, partial(_counted, _fn=fn, _calls=calls))
    return calls
