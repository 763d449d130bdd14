"""Rule-based rewards: math (math-verify), exact match, regex format, user `module:function`.

A reward function is `fn(completion: str, answer: str, **kwargs) -> float`. `RewardFn` sums the
configured terms with their weights. Every call runs under a deadline; an exception, a timeout or
a non-finite value scores 0 and is counted in the metrics (`reward_errors`, `reward_timeouts`):
scoring never raises.

Isolation (RewardConfig.isolation):
- thread (default): each call runs in a daemon thread joined with a deadline. Cheap, but Python
  cannot kill a thread: an overrunning call is abandoned and runs on in the background (counted in
  `reward_stuck_threads`), and one long C-level operation that holds the GIL (a huge integer
  power) also delays the deadline itself. Abandoned calls are bounded: once
  `max_stuck_threads` are still running, the run switches to process isolation for good (one
  warning; metric `reward_process_isolation`), so a reward that hangs for ever costs at most
  that many threads.
- process: calls run in a pool of spawned worker processes, `num_workers` at a time; when one
  overruns, the pool is killed and restarted. Robust against anything, costs a process start
  (imports) per restart. Terms are resolved by name inside the workers.
- none: direct calls in the caller's thread, no deadline.
math-verify's own timeout uses signal.alarm, which only works in a main thread: in worker threads
it is called with its timeouts off and our deadline bounds it instead.
"""
from __future__ import annotations

import inspect
import logging
import math
import multiprocessing.pool
import os
import re
import threading
import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from megagrpo.config.data import RewardConfig
from megagrpo.names import import_object
from megagrpo.procs import exit_with_parent

log = logging.getLogger("megagrpo")

RewardCallable = Callable[..., float]
_THREAD_PREFIX = "megagrpo-reward"


# ---------------------------------------------------------------------------------------------
# built-in reward functions


def math_reward(completion: str, answer: str) -> float:
    """1.0 if math-verify finds the completion's final answer equivalent to `answer`, else 0.0."""
    # Imported here: math-verify pulls in sympy (slow import) and only math tasks need it.
    from math_verify import parse, verify

    in_main = threading.current_thread() is threading.main_thread()
    limit = 5 if in_main else None  # signal.alarm works only in the main thread
    gold = parse(answer, parsing_timeout=limit, raise_on_error=True)
    pred = parse(completion, parsing_timeout=limit, raise_on_error=True)
    return float(verify(gold, pred, timeout_seconds=limit, raise_on_error=True))


def normalize_answer(text: str) -> str:
    """Lower-case, drop surrounding $ / spaces / a final period, collapse whitespace, drop the
    thousands commas of numbers ('1,000' -> '1000')."""
    text = text.strip().strip("$").strip().rstrip(".").strip()
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)
    return " ".join(text.lower().split())


def exact_match_reward(completion: str, answer: str, pattern: str = "") -> float:
    """1.0 if the normalised completion equals the normalised answer.

    With `pattern`, the completion is first reduced to group 1 (or the whole match) of the LAST
    match of that regex, e.g. pattern '#### (.+)' for GSM8K-style answers."""
    if pattern:
        matches = list(re.finditer(pattern, completion, flags=re.DOTALL))
        if not matches:
            return 0.0
        last = matches[-1]
        completion = last.group(1) if last.groups() else last.group(0)
    return float(normalize_answer(completion) == normalize_answer(answer))


def format_reward(completion: str, answer: str, pattern: str, full: bool = True) -> float:
    """1.0 if the completion matches regex `pattern` (DOTALL; whole string if `full`)."""
    match = re.fullmatch if full else re.search
    return float(match(pattern, completion, flags=re.DOTALL) is not None)


BUILTIN_REWARDS: dict[str, str] = {
    "math": "megagrpo.rewards:math_reward",
    "exact_match": "megagrpo.rewards:exact_match_reward",
    "format": "megagrpo.rewards:format_reward",
    "arithmetic": "megagrpo.tasks.arithmetic:reward",
}


def resolve_reward(name: str) -> RewardCallable:
    """A built-in name (see BUILTIN_REWARDS) or an import string 'package.module:function'.

    The module is imported like any Python module: it must be on the trainer's import path
    (the launch directory, or a folder on PYTHONPATH). Failures raise ValueError saying so."""
    target = BUILTIN_REWARDS.get(name, name)
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ValueError(
            f"reward {name!r}: use one of {sorted(BUILTIN_REWARDS)} or 'module:function'"
        )
    fn = import_object(target, f"reward {name!r}")
    if not callable(fn):
        raise ValueError(f"reward {name!r} resolves to a non-callable {type(fn).__name__}")
    return fn


def check_reward_kwargs(name: str, fn: RewardCallable, kwargs: dict) -> None:
    """Raise ValueError unless `fn(completion, answer, **kwargs)` binds: a misspelled keyword
    would otherwise make every call fail, scoring 0 for the whole run."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable without a signature: trust it
        return
    try:
        sig.bind("completion", "answer", **kwargs)
    except TypeError as e:
        params = [p for p in sig.parameters.values()
                  if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        accepts = ", ".join(p.name for p in params[2:]) or "no keyword arguments"
        raise ValueError(
            f"reward {name!r} with kwargs {kwargs}: {e}. A reward function is called as "
            f"fn(completion: str, answer: str, **kwargs) -> float; "
            f"{getattr(fn, '__name__', name)} accepts {accepts} after (completion, answer)"
        ) from None


def resolve_terms(cfg: RewardConfig) -> list[RewardCallable]:
    """Each term's function, resolved and checked against its kwargs; errors name the term."""
    fns = []
    for i, term in enumerate(cfg.terms):
        try:
            fn = resolve_reward(term.name)
            check_reward_kwargs(term.name, fn, term.kwargs)
        except ValueError as e:
            raise ValueError(f"reward.terms[{i}]: {e}") from None
        fns.append(fn)
    return fns


# ---------------------------------------------------------------------------------------------
# calls under a deadline


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


# ---------------------------------------------------------------------------------------------
# the configured weighted sum


class RewardFn:
    """Weighted sum of reward terms built from a `RewardConfig`."""

    def __init__(self, cfg: RewardConfig) -> None:
        """`cfg` is checked already (`RewardConfig.validate`, in the preflight); the terms are
        resolved here (unknown names and keyword arguments raise, as in the preflight)."""
        self.cfg = cfg
        self.fns = resolve_terms(cfg)  # fail fast on bad names and keyword arguments
        self.labels = _unique_labels([t.name for t in cfg.terms])
        marked = [label for t, label in zip(cfg.terms, self.labels) if t.correctness]
        self.correctness_label = marked[0] if marked else self.labels[0]
        """The term held-out accuracy is measured on (`correct`)."""
        self.processes = ProcessScorer(cfg.num_workers) if cfg.isolation == "process" else None

    def score(
        self, completions: Sequence[str], answers: Sequence[str]
    ) -> tuple[Tensor, dict[str, Tensor], dict[str, float]]:
        """Score N completions against their reference answers.

        Returns (total [N] float32, {term label: [N] unweighted}, metrics). Never raises for a
        failing reward call: it scores 0 and counts in reward_errors / reward_timeouts."""
        if len(completions) != len(answers):
            raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
        start = time.perf_counter()
        pairs = list(zip(completions, answers, strict=True))
        per_term: dict[str, Tensor] = {}
        metrics = {"reward_errors": 0.0, "reward_timeouts": 0.0}
        total = torch.zeros(len(completions), dtype=torch.float32)
        for term, fn, label in zip(self.cfg.terms, self.fns, self.labels, strict=True):
            scored = self._run_term(term.name, fn, pairs, term.kwargs)
            values = torch.tensor([v for v, _ in scored], dtype=torch.float32)
            for _, status in scored:
                if status != "ok":
                    metrics[f"reward_{status}s"] += 1
            per_term[label] = values
            total += term.weight * values
            metrics[f"reward/{label}"] = float(values.mean()) if len(values) else 0.0
        metrics["reward_time_s"] = time.perf_counter() - start
        # the same keys whatever the isolation: ranks that switched average with ranks that
        # did not (the trainer all-reduces these by key)
        metrics["reward_stuck_threads"] = float(stuck_reward_threads())
        metrics["reward_pool_restarts"] = float(self.processes.restarts if self.processes else 0)
        metrics["reward_process_isolation"] = float(self.processes is not None)
        return total, per_term, metrics

    def correct(self, per_term: dict[str, Tensor]) -> Tensor:
        """[N] bool from `score`'s per-term values: the correctness term's unweighted value is
        >= 1. Other terms (a format bonus, a length term) never make an answer correct."""
        return per_term[self.correctness_label] >= 1.0

    def _run_term(
        self, name: str, fn: RewardCallable, pairs: list[tuple[str, str]], kwargs: dict
    ) -> list[tuple[float, str]]:
        if self.processes is not None:
            return self.processes.run(name, pairs, kwargs, self.cfg.timeout_s)
        if self.cfg.isolation == "none":
            return [call_with_deadline(fn, c, a, kwargs, None) for c, a in pairs]
        out: list[tuple[float, str]] = []
        for i, (c, a) in enumerate(pairs):
            stuck = stuck_reward_threads()
            if stuck >= self.cfg.max_stuck_threads:  # the rest, and every later call, in processes
                self._switch_to_processes(stuck)
                return out + self.processes.run(name, pairs[i:], kwargs, self.cfg.timeout_s)
            out.append(call_with_deadline(fn, c, a, kwargs, self.cfg.timeout_s))
        return out

    def _switch_to_processes(self, stuck: int) -> None:
        """Thread isolation cannot stop an overrunning call; worker processes can be killed."""
        log.warning(
            "reward: %d timed-out reward calls are still running in threads of this process "
            "(reward.max_stuck_threads=%d; Python cannot stop a thread): switching to "
            "reward.isolation=process, whose workers are killed on timeout, for the rest of the "
            "run. Set reward.isolation=process to start that way, or fix the hanging reward",
            stuck, self.cfg.max_stuck_threads)
        self.processes = ProcessScorer(self.cfg.num_workers)

    def close(self) -> None:
        """Stop worker processes (isolation=process); a later score() starts them again."""
        if self.processes is not None:
            self.processes.close()


def _unique_labels(names: list[str]) -> list[str]:
    """Term labels for metrics: the name, suffixed '#k' from its second occurrence on."""
    seen: dict[str, int] = {}
    labels = []
    for name in names:
        k = seen.get(name, 0)
        seen[name] = k + 1
        labels.append(name if k == 0 else f"{name}#{k}")
    return labels
