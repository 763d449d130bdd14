"""Reward calls under a deadline: a daemon thread per call, or a pool of killable worker
processes. Every call returns (score, status), status 'ok', 'error' or 'timeout': an exception,
a timeout or a non-finite value scores 0 and is counted by the caller; scoring never raises.

- thread: each call runs in a daemon thread joined with a deadline. Cheap, but Python cannot
  kill a thread: an overrunning call is abandoned and runs on in the background (counted by
  `stuck_reward_threads`), and one long C-level operation that holds the GIL (a huge integer
  power) also delays the deadline itself. `RuleTerms` bounds the abandoned calls
  (reward.max_stuck_threads) by switching to processes for good.
- process (`ProcessScorer`): calls run in a pool of spawned worker processes, `num_workers` at a
  time; when one overruns, the pool is killed and restarted. Robust against anything, costs a
  process start (imports) per restart. Terms are resolved by name inside the workers.
math-verify's own timeout uses signal.alarm, which only works in a main thread: in worker threads
it is called with its timeouts off and our deadline bounds it instead.
"""
from __future__ import annotations

import math
import multiprocessing.pool
import os
import threading
import time
from collections.abc import Sequence

from megagrpo.reward.rules import RewardCallable, resolve_reward
from megagrpo.runtime.procs import exit_with_parent

_THREAD_PREFIX = "megagrpo-reward-call"




class _Call(threading.Thread):
    """One reward call in a daemon thread; the caller joins it with a deadline."""

    def __init__(self, fn: RewardCallable, completion: str, answer: str, kwargs: dict) -> None:
        super().__init__(name=f"{_THREAD_PREFIX}-{getattr(fn, '__name__', 'fn')}", daemon=True)
        self.fn, self.args, self.kwargs = fn, (completion, answer), kwargs
        self.value: float | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.value = self.fn(*self.args, **self.kwargs)
        except BaseException as e:  # noqa: BLE001 - anything a user reward throws scores 0
            self.error = e


def call_with_deadline(
    fn: RewardCallable, completion: str, answer: str, kwargs: dict, timeout_s: float | None
) -> tuple[float, str]:
    """Run one reward call. Returns (score, status), status one of 'ok', 'error', 'timeout'.

    timeout_s None: call directly in this thread (no deadline)."""
    call = _Call(fn, completion, answer, kwargs)
    if timeout_s is None:
        call.run()
    else:
        call.start()
        call.join(timeout_s)
        if call.is_alive():
            return 0.0, "timeout"
    if call.error is not None:
        return 0.0, "error"
    return _as_score(call.value)


def _as_score(value: object) -> tuple[float, str]:
    """(float, 'ok') for a finite number (or bool), else (0.0, 'error')."""
    try:
        score = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0.0, "error"
    return (score, "ok") if math.isfinite(score) else (0.0, "error")


def stuck_reward_threads() -> int:
    """Abandoned (timed-out) reward calls still running in this process."""
    return sum(t.name.startswith(_THREAD_PREFIX) and t.is_alive() for t in threading.enumerate())


# ---------------------------------------------------------------------------------------------
# calls in worker processes


def _process_call(name: str, completion: str, answer: str, kwargs: dict) -> tuple[float, str]:
    """Runs inside a pool worker: resolve the term by name, call it, never raise."""
    try:
        return _as_score(resolve_reward(name)(completion, answer, **kwargs))
    except BaseException:  # noqa: BLE001 - anything a user reward throws scores 0
        return 0.0, "error"


def _worker_pid(_: int) -> int:
    time.sleep(0.05)  # long enough that each of the first calls lands on a different worker
    return os.getpid()


class ProcessScorer:
    """A pool of spawned worker processes running reward calls under a deadline; a call that
    overruns gets the whole pool killed and restarted (the only way to stop it for sure)."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.pool: multiprocessing.pool.Pool | None = None
        self.restarts = 0

    def _ready_pool(self) -> multiprocessing.pool.Pool:
        if self.pool is None:
            # spawn, not fork: the trainer process holds threads (and CUDA/NCCL state on GPU)
            self.pool = multiprocessing.get_context("spawn").Pool(
                self.num_workers, initializer=exit_with_parent, initargs=(os.getpid(),))
            # Wait (no deadline) until every worker has started and imported this module, so
            # start-up time is never charged to the first calls.
            pids: set[int] = set()
            for _ in range(10):
                pids.update(self.pool.map(_worker_pid, range(self.num_workers), chunksize=1))
                if len(pids) >= self.num_workers:
                    break
        return self.pool

    def run(
        self, name: str, pairs: Sequence[tuple[str, str]], kwargs: dict, timeout_s: float
    ) -> list[tuple[float, str]]:
        """(score, status) per (completion, answer); num_workers calls at a time, so each call's
        deadline starts when it does."""
        out: list[tuple[float, str]] = []
        for start in range(0, len(pairs), self.num_workers):
            window = pairs[start:start + self.num_workers]
            pending = [self._ready_pool().apply_async(_process_call, (name, c, a, kwargs))
                       for c, a in window]
            deadline = time.monotonic() + timeout_s
            for result in pending:
                result.wait(max(0.0, deadline - time.monotonic()))
                out.append(result.get() if result.ready() else (0.0, "timeout"))
            if any(status == "timeout" for _, status in out[start:]):
                self.close()
                self.restarts += 1
        return out

    def close(self) -> None:
        """Kill the workers (they are restarted on the next call)."""
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
            self.pool = None


