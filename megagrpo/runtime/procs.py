"""Process lifetime: a launcher's children must not outlive it.

`python -m megagrpo train` relaunches itself under torchrun, which starts the ranks. Killing the
launcher used to orphan torchrun and its ranks, which trained on. Two mechanisms close that:
- `run_child` starts the child with PR_SET_PDEATHSIG (Linux: the kernel sends the child a signal
  when its parent dies; the setting survives exec, so it covers even SIGKILL of the launcher) and
  forwards SIGINT / SIGTERM / SIGHUP to it while it runs.
- `follow_parent` lets a rank do the same towards torchrun, so a killed torchrun (whose own
  clean-up of its workers then never runs) takes its ranks down.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
from functools import partial

_PR_SET_PDEATHSIG = 1
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> bool:
    """Asks the kernel to send `sig` to this process when its parent exits. If the parent is
    already gone (it is not `parent` any more), sends it at once. Linux only; returns False
    where prctl is unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if parent is not None and os.getppid() != parent:  # died before prctl took effect
        os.kill(os.getpid(), sig)
    return True


def follow_parent() -> None:
    """Under torchrun: die (SIGKILL) when the torchrun agent that started this rank dies."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent(signal.SIGKILL, parent=os.getppid())


def exit_with_parent(parent: int, poll_s: float = 0.5) -> None:
    """For helper processes a rank spawns through multiprocessing (reward pool workers, the
    checkpoint writer's queue manager): a daemon thread ends this process with os._exit once
    `parent` is gone. A rank killed with SIGKILL never stops them, and a manager server sits
    in accept() for good (a ~270 MB orphan per killed rank). Polling, not PR_SET_PDEATHSIG:
    that fires when the spawning *thread* ends, and pools respawn workers from their own."""
    import threading
    import time

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="megagrpo-parent-watch", daemon=True).start()


_WRITE_QUEUE_MANAGER = None


def watched_checkpoint_queue() -> None:
    """Gives megatron-core's async filesystem writer (used by every torch_dist save) its
    results queue from a spawned manager whose server ends with this rank (`exit_with_parent`);
    megatron's own, made on the first save, outlives a killed rank. Once per process."""
    global _WRITE_QUEUE_MANAGER
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if _WRITE_QUEUE_MANAGER is not None or filesystem_async._results_queue is not None:
        return
    import multiprocessing
    from multiprocessing.managers import SyncManager

    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(initializer=exit_with_parent, initargs=(os.getpid(),))
    filesystem_async._results_queue = manager.Queue()
    _WRITE_QUEUE_MANAGER = manager


def run_child(cmd: list[str], env: dict[str, str]) -> int:
    """Runs `cmd` to completion as a child that dies with this process (SIGTERM, so torchrun
    can still stop its ranks) and receives the signals this process gets. Returns its exit
    code (128 + signal number when a signal ended it)."""
    child = subprocess.Popen(cmd, env=env,
                             preexec_fn=partial(die_with_parent, signal.SIGTERM, os.getpid()))
    previous = {s: signal.signal(s, partial(_forward, child)) for s in _FORWARDED}
    try:
        rc = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 128 - rc if rc < 0 else rc


def _forward(child: subprocess.Popen, signum: int, _frame) -> None:
    if child.poll() is None:
        child.send_signal(signum)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no one listens on now (the OS picks it: never a fixed one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
