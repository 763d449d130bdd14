"""megatron-core's checkpoint writer processes, watched: a dead writer stops the save in seconds.

Every torch_dist save (`dist_checkpointing.save`) hands this rank's files to megatron's
`FileSystemWriterAsync.write_preloaded_data_multiproc`, which forks one writer process per file
and then waits, with no time limit, for each to say it is done. A writer that dies (SIGKILL,
the OOM killer) never says so, and the rank used to wait for good: only the watchdog's
`watchdog.stall_timeout_s` (30 min by default) ended it.

`watch_writers(request, folder)` gives back the save's request with that wait made finite: the
write runs in a side thread while the rank polls its writers every `POLL_S`. A writer ended by a
signal or a non-zero exit code, or every writer ended (one of them unseen, below) while the
write still waits, stops the save within seconds, on every rank at once (one all-reduce per
save): this rank raises `WriterDied` naming the writer's pid, how it ended and the folder; the
others say which rank's writer died. The checkpoint the folder belongs to then has no manifest,
so it is never taken for a complete one (`run_dir.newest_intact`).

The writers are found exactly: each child the writing thread forks sends its pid down a pipe
(an at-fork hook), and how a writer ended is read with waitid(WNOWAIT), which leaves the child
for multiprocessing to collect. multiprocessing may collect a writer itself before this rank
reads it (one that ended before megatron started the next); that end is unknown and is judged
by whether the write finishes within `SETTLE_S` of the last writer's end.
"""
from __future__ import annotations

import gc
import inspect
import os
import signal
import struct
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

POLL_S = 0.2
"""How often the rank looks at its writers while the write waits."""
GRACE_S = 2.0
"""A writer that died after it reported (its files written): the write ends within this. One
killed in that last instant while a slower writer still writes past GRACE_S stops the save
all the same: a save that would have completed is then reported as incomplete (safe: the
checkpoint before is intact)."""
SETTLE_S = 10.0
"""Every writer ended but how some ended is unknown: the write ends within this, or is stuck
(what is left after the last writer's end is reading the writers' small reports)."""

_PID = struct.Struct("=i")
_RUNNING, _UNKNOWN = "running", "unknown"


class WriterDied(RuntimeError):
    """A checkpoint writer process died, here or on another rank: the save did not complete."""


@dataclass
class _Watch:
    """The write in progress: the thread that forks the writers and the pipe their pids come
    through."""

    thread: int
    fd: int


_watch: _Watch | None = None
"""The write being watched (at most one per process: a save is collective)."""


def _note_fork() -> None:
    """In every forked child: a writer (forked by the watched thread) sends its pid home."""
    w = _watch
    if w is not None and threading.get_ident() == w.thread:
        os.write(w.fd, _PID.pack(os.getpid()))


# at import, so that it runs first in a child (hooks run in the order they were registered)
os.register_at_fork(after_in_child=_note_fork)


def watch_writers(request, folder: str | os.PathLike):
    """megatron's AsyncRequest for a save into `folder`, its write watched (see the module
    doc); wrapped on every rank, also where this rank has nothing to write (the ranks agree
    once whether every writer lived)."""
    return request._replace(async_fn=partial(_agreed_write, request.async_fn, Path(folder)))


def _agreed_write(write, folder: Path, *args, **kwargs) -> None:
    """Runs this rank's write (if any) watched, then agrees with the other ranks: if a writer
    died anywhere, every rank raises (this one naming its writer)."""
    died: WriterDied | None = None
    if write is not None:
        try:
            _watched(partial(write, *args, **kwargs), folder, _writer_count(write, args, kwargs))
        except WriterDied as e:
            died = e
    worst = torch.tensor([dist.get_rank() + 1 if died else 0])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if died is not None:
        raise died
    if worst.item():
        raise WriterDied(f"a checkpoint writer process of rank {int(worst.item()) - 1} died "
                         f"while writing {folder} (rank {int(worst.item()) - 1}'s error names "
                         "it); this rank's files were written")


def _writer_count(write, args: tuple, kwargs: dict) -> int | None:
    """How many writer processes megatron's write forks: one per write bucket (None where its
    signature has no `write_buckets`)."""
    try:
        buckets = inspect.signature(write).bind_partial(*args, **kwargs).arguments.get(
            "write_buckets")
    except (TypeError, ValueError):
        return None
    return None if buckets is None else len(buckets)


def _watched(write, folder: Path, expected: int | None = None) -> None:
    """Runs `write` in a side thread and returns when it does (raising what it raised), or
    raises WriterDied once its writers say it will not. `expected`: how many writers it forks
    (None: unknown, then those seen so far are taken for all)."""
    global _watch
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    outcome: list[BaseException | None] = []
    gc_was_on = gc.isenabled()  # megatron's write turns it off until it returns
    thread = threading.Thread(target=_run, args=(write, write_fd, outcome),
                              name="megagrpo-checkpoint-write", daemon=True)
    thread.start()
    try:
        died = _wait(thread, read_fd, expected)
    finally:
        _watch = None
        os.close(read_fd)
        os.close(write_fd)
    if died:  # the thread stays blocked in megatron's wait (a daemon: it ends with the rank)
        if gc_was_on:
            gc.enable()
        raise WriterDied(_describe(died, folder))
    if outcome[0] is not None:
        raise outcome[0]


def _run(write, fd: int, outcome: list) -> None:
    """The side thread: marks itself as the one whose forks are writers, then writes; what it
    raised, or None, goes to `outcome`."""
    global _watch
    _watch = _Watch(threading.get_ident(), fd)  # before the first fork
    try:
        write()
        outcome.append(None)
    except BaseException as e:  # noqa: BLE001 - re-raised in the calling thread
        outcome.append(e)


def _wait(thread: threading.Thread, read_fd: int, expected: int | None = None
          ) -> dict[int, str]:
    """Polls until the write ends ({}) or its writers say it never will: {pid: end} of
    those that ended badly (after GRACE_S), or of every one once all `expected` writers were
    seen, none runs and the write still waits after SETTLE_S (one that died unseen). A writer
    killed before it could say its pid leaves the count short: that stall is the watchdog's."""
    ends: dict[int, str] = {}
    since: float | None = None
    while True:
        thread.join(POLL_S)
        if not thread.is_alive():
            return {}
        ends.update({pid: _RUNNING for pid in _new_pids(read_fd) if pid not in ends})
        for pid, end in ends.items():
            if end == _RUNNING:
                ends[pid] = _end_of(pid)
        bad = {p: e for p, e in ends.items() if e not in (_RUNNING, _UNKNOWN, "exit code 0")}
        starting = expected is not None and len(ends) < expected  # more writers to be forked
        unseen = _UNKNOWN in ends.values()  # every known end a clean exit: nobody died
        if not bad and (starting or not unseen or _RUNNING in ends.values()):
            since = None  # writers at work, starting or done: a stall is the watchdog's
            continue
        since = since if since is not None else time.monotonic()
        if time.monotonic() - since >= (GRACE_S if bad else SETTLE_S):
            return bad or {p: e for p, e in ends.items() if e == _UNKNOWN} or ends


def _new_pids(read_fd: int) -> list[int]:
    try:
        data = os.read(read_fd, 4096)
    except BlockingIOError:
        return []
    return [pid for (pid,) in _PID.iter_unpack(data)]


def _end_of(pid: int) -> str:
    """How child `pid` ended, without collecting it: _RUNNING, 'exit code N', 'signal NAME
    (N)', or _UNKNOWN where someone (multiprocessing) collected it already."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return _UNKNOWN
    if info is None or info.si_pid == 0:
        return _RUNNING
    if info.si_code == os.CLD_EXITED:
        return f"exit code {info.si_status}"
    try:
        name = signal.Signals(info.si_status).name
    except ValueError:
        name = "signal"
    return f"signal {name} ({info.si_status})"


def _describe(died: dict[int, str], folder: Path) -> str:
    rank = dist.get_rank() if dist.is_initialized() else 0
    which = "; ".join(f"pid {pid} {_how(end)}" for pid, end in sorted(died.items()))
    if all(end in (_UNKNOWN, "exit code 0") for end in died.values()):
        which += (f"; the write still waited {SETTLE_S:.0f} s after every writer it knew of had "
                  "ended")
    return (f"a checkpoint writer process of rank {rank} died while writing {folder}: {which}; "
            "its files were not written")


def _how(end: str) -> str:
    if end == _UNKNOWN:
        return "ended without reporting (its exit status was collected by multiprocessing)"
    return f"was killed by {end}" if end.startswith("signal") else f"ended with {end}"
