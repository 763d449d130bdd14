"""Rule-based rewards: math (math-verify), exact match, regex format, user `module:function`.

A reward function is `fn(completion: str, answer: str, **kwargs) -> float`. `RewardFn` sums the
configured terms with their weights. Every call runs under a deadline; an exception, a timeout or
a non-finite value scores 0 and is counted in the metrics (`reward_errors`, `reward_timeouts`):
scoring never raises.

Timeouts: each call runs in a daemon worker thread joined with a deadline. Python cannot kill a
thread, so a call that overruns is abandoned (it finishes, or not, in the background; the count of
still-running ones is `reward_stuck_threads`). math-verify's own timeout uses signal.alarm, which
only works in the main thread, so inside workers it is called with its timeouts off and our
deadline bounds it instead.
"""
from __future__ import annotations

import importlib
import math
import re
import threading
import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from megagrpo.config.data import RewardConfig

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
    """A built-in name (see BUILTIN_REWARDS) or an import string 'package.module:function'."""
    target = BUILTIN_REWARDS.get(name, name)
    if ":" not in target:
        raise ValueError(
            f"reward {name!r}: use one of {sorted(BUILTIN_REWARDS)} or 'module:function'"
        )
    module_name, _, attr = target.partition(":")
    fn = importlib.import_module(module_name)
    for part in attr.split("."):
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"reward {name!r} resolves to a non-callable {type(fn).__name__}")
    return fn


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
    try:
        value = float(call.value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0.0, "error"
    return (value, "ok") if math.isfinite(value) else (0.0, "error")


def stuck_reward_threads() -> int:
    """Abandoned (timed-out) reward calls still running in this process."""
    return sum(t.name.startswith(_THREAD_PREFIX) and t.is_alive() for t in threading.enumerate())


# ---------------------------------------------------------------------------------------------
# the configured weighted sum


class RewardFn:
    """Weighted sum of reward terms built from a `RewardConfig`."""

    def __init__(self, cfg: RewardConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self.fns = [resolve_reward(t.name) for t in cfg.terms]
        self.labels = _unique_labels([t.name for t in cfg.terms])

    def score(
        self, completions: Sequence[str], answers: Sequence[str]
    ) -> tuple[Tensor, dict[str, Tensor], dict[str, float]]:
        """Score N completions against their reference answers.

        Returns (total [N] float32, {term label: [N] unweighted}, metrics). Never raises for a
        failing reward call: it scores 0 and counts in reward_errors / reward_timeouts."""
        if len(completions) != len(answers):
            raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
        timeout = self.cfg.timeout_s if self.cfg.isolation == "thread" else None
        start = time.perf_counter()
        per_term: dict[str, Tensor] = {}
        metrics = {"reward_errors": 0.0, "reward_timeouts": 0.0}
        total = torch.zeros(len(completions), dtype=torch.float32)
        for term, fn, label in zip(self.cfg.terms, self.fns, self.labels, strict=True):
            values = torch.zeros(len(completions), dtype=torch.float32)
            for i, (completion, answer) in enumerate(zip(completions, answers, strict=True)):
                value, status = call_with_deadline(fn, completion, answer, term.kwargs, timeout)
                values[i] = value
                if status != "ok":
                    metrics[f"reward_{status}s"] += 1
            per_term[label] = values
            total += term.weight * values
            metrics[f"reward/{label}"] = float(values.mean()) if len(values) else 0.0
        metrics["reward_time_s"] = time.perf_counter() - start
        metrics["reward_stuck_threads"] = float(stuck_reward_threads())
        return total, per_term, metrics


def _unique_labels(names: list[str]) -> list[str]:
    """Term labels for metrics: the name, suffixed '#k' from its second occurrence on."""
    seen: dict[str, int] = {}
    labels = []
    for name in names:
        k = seen.get(name, 0)
        seen[name] = k + 1
        labels.append(name if k == 0 else f"{name}#{k}")
    return labels
