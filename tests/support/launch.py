"""Starting ranks for tests: a worker script on local ranks (real processes over gloo, started
as torchrun would start them, without its agent) and torch.multiprocessing spawns of an
importable worker function."""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megagrpo.cli import free_port, torchrun_command
from tests.support import child_env

__all__ = ["SHARED_LOG", "count_collectives", "free_port", "gloo_rank", "job_output", "run_jobs",
           "run_ranks", "run_ranks_results", "save_rank", "shared_output", "spawn_ranks",
           "torchrun_command", "worker_args", "worker_env", "write_results"]


def worker_env(**changes: str | None) -> dict[str, str]:
    """`child_env` for a launched worker: one OpenMP thread per rank and unbuffered output (a
    worker runs as a `__main__` file and imports `tests.support` from the root on
    PYTHONPATH)."""
    return child_env(**{"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **changes})


def run_ranks(script: str | Path, nproc: int, *args: str, timeout: float = 600,
              env: dict[str, str] | None = None) -> str:
    """Runs `script ARGS` on `nproc` local ranks (env: `worker_env()` unless given) and returns
    their output (stdout, then stderr, each rank's lines interleaved as written), or raises with
    its tail when a rank fails.

    The ranks are plain processes given the variables torchrun gives its workers (RANK,
    LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT), without torchrun's elastic
    agent: rank 0's init_process_group serves the store. The agent cost ~1.3 s of CPU and 1-3 s
    of wall time per launch on 2 cores (its own torch import, rendezvous, monitoring) and
    restarts nothing here (--max-restarts=0). As under torchrun, the first rank to fail ends
    the others (each rank and what it started is killed as a process group); a timeout kills
    them all and raises `subprocess.TimeoutExpired`. The code paths torchrun itself drives
    (restarts, the agent's store, `megagrpo train`'s relaunch) are tested through
    `torchrun_command` and the command line."""
    base = env or worker_env()
    port = str(free_port())
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        outs = [os.open(os.path.join(tmp, name), os.O_RDWR | os.O_CREAT | os.O_APPEND)
                for name in ("stdout", "stderr")]
        try:
            procs = [subprocess.Popen(
                [sys.executable, str(script), *args], stdout=outs[0], stderr=outs[1],
                stdin=subprocess.DEVNULL, start_new_session=True,
                env=dict(base, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc),
                         LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", ROLE_RANK=str(r),
                         ROLE_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
                for r in range(nproc)]
            failed = _wait_ranks(procs, time.monotonic() + timeout)
        finally:
            for fd in outs:
                os.close(fd)
        out = "".join(Path(tmp, name).read_text(errors="replace") for name in ("stdout", "stderr"))
    if failed == "timeout":
        raise subprocess.TimeoutExpired([str(script), *args], timeout, output=out[-8000:])
    if failed is not None:
        raise RuntimeError(f"{nproc} ranks of {script} failed ({failed}):\n{out[-8000:]}")
    return out


def _wait_ranks(procs: list[subprocess.Popen], deadline: float) -> str | None:
    """Waits for every rank; None when all exited 0, else what went wrong ('rank R rc=N', the
    first to fail, or 'timeout'), after killing the process groups of the ranks still running."""
    failed = None
    try:
        while failed is None:
            codes = [p.poll() for p in procs]  # every rank polled, each time
            bad = [(r, rc) for r, rc in enumerate(codes) if rc not in (None, 0)]
            if bad:
                failed = f"rank {bad[0][0]} rc={bad[0][1]}"
            elif None not in codes:
                break
            elif time.monotonic() > deadline:
                failed = "timeout"
            else:
                time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                with suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return failed


def run_ranks_results(script: str | Path, nproc: int, work: Path, *args: str,
                      timeout: float = 600) -> Any:
    """`run_ranks` of a worker that takes `--work WORK` and ends with `write_results`; returns
    what it wrote (WORK/results.json)."""
    run_ranks(script, nproc, "--work", str(work), *args, timeout=timeout)
    return json.loads((work / "results.json").read_text())


def alive(pid: int) -> bool:
    """Whether process `pid` still runs: it exists and is not a zombie (killed, not reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def run_jobs(jobs: list[tuple[list[str | Path], Path]], nproc: int,
             timeout: float = 600) -> None:
    """`run_ranks` of several workers, each `([script, *args], log)`, one after another in the
    same `nproc` rank processes (tests/_jobs_worker.py); a job's output goes to LOG.rankR
    (`job_output` reads it). When a job fails, the error ends with its output's tail."""
    jobs_worker = Path(__file__).resolve().parents[1] / "_jobs_worker.py"
    ports: set[int] = set()
    while len(ports) < len(jobs):  # one rendezvous port per job (tests/_jobs_worker.py)
        ports.add(free_port())
    spec = [{"argv": [str(a) for a in argv], "log": str(log), "port": port}
            for (argv, log), port in zip(jobs, sorted(ports))]
    try:
        run_ranks(jobs_worker, nproc, json.dumps(spec), timeout=timeout)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        started = [log for _, log in jobs if Path(f"{log}.rank0").exists()]
        tail = job_output(started[-1], nproc)[-8000:] if started else ""
        raise RuntimeError(f"{e}\n--- output of the last job started ({started[-1:]}):\n"
                           f"{tail}") from e


def job_output(log: Path, nproc: int) -> str:
    """A `run_jobs` job's output: its ranks' LOG.rankR files, rank order."""
    return "".join(Path(f"{log}.rank{r}").read_text(errors="replace") for r in range(nproc)
                   if Path(f"{log}.rank{r}").exists())


SHARED_LOG = "output"
"""The log of a job of tests/conftest.py's shared launches: WORK/output.rankR."""


def shared_output(work: Path, nproc: int) -> str:
    """The output of a shared launch's job whose work folder is `work` (tests/conftest.py)."""
    return job_output(work / SHARED_LOG, nproc)


def worker_args(**options: str) -> argparse.Namespace:
    """In a worker: its command line parsed, `--work WORK` (required) and one
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
    """In a `run_ranks` worker, on every rank: the ranks' `results` gathered, and rank 0 writes
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


def run_loopback_nodes(recipe: Path, ranks: tuple[int, ...], *overrides: str,
                       timeout: float = 900) -> list[str]:
    """examples/launch_multinode.sh once per "node" on this machine (c10d rendezvous on
    127.0.0.1), node n with `ranks[n]` ranks (ranks go node by node), the recipe plus
    `overrides`; returns each node's console (stdout and stderr). Asserts every node exits 0."""
    from tests.support import ROOT

    env = worker_env(NNODES=str(len(ranks)), MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port()), PYTHON=sys.executable,
                     RDZV_ID=f"test{os.getpid()}{recipe.parent.name}")
    nodes = [subprocess.Popen(["bash", str(ROOT / "examples" / "launch_multinode.sh"),
                               str(recipe), *overrides], cwd=ROOT,
                              env=dict(env, NODE_RANK=str(n), GPUS_PER_NODE=str(k)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n, k in enumerate(ranks)]
    outs = []
    try:
        outs = [node.communicate(timeout=timeout)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    for node, out in zip(nodes, outs):
        assert node.returncode == 0, out[-6000:]
    return outs
