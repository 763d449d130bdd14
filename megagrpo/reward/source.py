"""The reward seam: a `RewardSource` scores a batch of whole samples; a registry builds the
configured one by name.

`score(samples)` returns `Scores` or a `concurrent.futures.Future` of them: a source that runs
elsewhere (a reward model on another device, a remote service, a pool) returns at once and the
collector awaits the result when it gathers the batch, so scoring overlaps later sampling.
Adding a source is one module in this folder that registers a builder under a name
(`@register_source("name")`), selected by `reward.source: name`; `module:Class` names a source
outside the package. A builder is called with the `RewardConfig` (its `options` are the
source's own keyword arguments) and may define `check(cfg)` (run in the preflight, before
compute).
"""
from __future__ import annotations

import importlib
import importlib.util
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from megagrpo.config.data import RewardConfig
from megagrpo.reward.sample import Sample
from megagrpo.runtime.names import import_object


@dataclass
class Scores:
    """A batch's rewards."""

    rewards: Tensor
    """[n] float32 total reward per sample."""
    per_term: dict[str, Tensor] = field(default_factory=dict)
    """{term label: [n] float32 unweighted value}."""
    correct: Tensor | None = None
    """[n] bool: the sample counts as solved (held-out accuracy); None = rewards >= 1."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Scalars for the step's log (the trainer averages them over ranks by key)."""
    valid: Tensor | None = None
    """[n] bool: False where the source could not score the sample (its reward is not used:
    the sample is left out of the loss); None = every sample scored."""
    gauges: frozenset[str] = frozenset()
    """Metric keys that are levels, not amounts (merged over slices of a batch by max; keys
    `reward/*` are means over the samples, every other key adds up)."""

    def correctness(self) -> Tensor:
        """[n] bool `correct`, or rewards >= 1 where the source gave none."""
        return self.correct.bool() if self.correct is not None else self.rewards >= 1.0


class RewardSource(Protocol):
    """Scores whole samples, batched."""

    def score(self, samples: list[Sample]) -> Scores | Future[Scores]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class RewardContext:
    """What the run hands a source that needs more than its config (`needs_context = True` on
    the builder: called as `builder(cfg, context)`), e.g. the judge's engine."""

    engine: object = None
    """This rank's rollout engine (`megagrpo.engine.RolloutEngine`), None where there is none."""
    tokenizer: object = None
    """The run's tokenizer (`megagrpo.data.Tokenizer`)."""
    stop_ids: tuple[int, ...] = ()
    """Token ids that end a completion."""
    engine_tp: int = 1
    """Ranks of the engine (rollout.tensor_parallel_size)."""
    max_model_len: int = 0
    """The engine's context (rollout.max_model_len); 0 = unknown."""


SourceBuilder = Callable[..., RewardSource]
SOURCES: dict[str, SourceBuilder] = {}
"""Registered reward sources by name (`reward.source`)."""


def register_source(name: str) -> Callable[[SourceBuilder], SourceBuilder]:
    """Class/function decorator: `reward.source: name` builds it with the `RewardConfig`."""
    def add(builder: SourceBuilder) -> SourceBuilder:
        SOURCES[name] = builder
        return builder
    return add


def source_builder(name: str) -> SourceBuilder:
    """The builder of `reward.source` name: registered, a module of this folder that registers
    it (imported on first use), or `module:Class`. Raises ValueError naming the field."""
    if name not in SOURCES and ":" not in name and name.isidentifier():
        module = f"{__package__}.{name}"
        if importlib.util.find_spec(module) is not None:
            importlib.import_module(module)
    if name in SOURCES:
        return SOURCES[name]
    if ":" in name:
        try:
            return import_object(name, f"reward.source {name!r}")
        except ValueError as e:
            raise ValueError(f"reward.source: {e}") from None
    raise ValueError(f"reward.source={name!r}: use one of {sorted(SOURCES)} (or a module of "
                     f"megagrpo/reward/ that registers that name), or 'module:Class'")


def build_source(builder: SourceBuilder, cfg: RewardConfig,
                 context: RewardContext | None) -> RewardSource:
    """`builder(cfg)`, or `builder(cfg, context)` for a builder with `needs_context`."""
    if getattr(builder, "needs_context", False):
        return builder(cfg, context or RewardContext())
    return builder(cfg)


def check_source(cfg: RewardConfig) -> None:
    """Preflight: the configured source resolves and accepts its section (no scoring)."""
    builder = source_builder(cfg.source)
    check = getattr(builder, "check", None)
    if check is not None:
        check(cfg)


class PendingScores:
    """Scores that may still be computing: `result()` waits for them. Keeps when scoring was
    submitted, when the submitting call returned and when the last part was ready (perf_counter
    seconds), from which the collector tells what scoring blocked and what it overlapped."""

    def __init__(self, parts: list[Scores | Future[Scores]],
                 join: Callable[[list[Scores]], Scores], submitted: float | None = None,
                 *, returned: float | None = None, blocked: float | None = None) -> None:
        self.parts, self.join = parts, join
        self._done: Scores | None = None
        self.returned = time.perf_counter() if returned is None else returned
        """When the (first) submitting call returned (sampling went on from here)."""
        self.blocked = (self.returned - (self.returned if submitted is None else submitted)
                        if blocked is None else blocked)
        """Seconds the submitting call(s) took: scoring that blocked sampling."""
        futures = [p for p in parts if isinstance(p, Future)]
        self.ready = self.returned
        """When the last part was ready (a future's completion; `returned` when none)."""
        self._left = len(futures)
        self._lock = threading.Lock()
        for f in futures:
            f.add_done_callback(self._one_ready)

    def _one_ready(self, _: Future) -> None:
        with self._lock:
            self._left -= 1
            if not self._left:
                self.ready = time.perf_counter()

    def timing(self, gather_start: float, gather_end: float) -> dict[str, float]:
        """The reward phase of a batch gathered over [gather_start, gather_end] (after
        `result()`): seconds scoring blocked the sampling thread (a synchronous source),
        overlapped other work (a future computing between the submit and the gather), and kept
        the gather waiting."""
        return {"reward_blocking_s": self.blocked,
                "reward_overlap_s": max(0.0, min(self.ready, gather_start) - self.returned),
                "reward_wait_s": gather_end - gather_start}

    def done(self) -> bool:
        return self._done is not None or all(
            not isinstance(p, Future) or p.done() for p in self.parts)

    def result(self) -> Scores:
        """The joined scores (waits for any future; a source's exception is raised here)."""
        if self._done is None:
            self._done = self.join([p.result() if isinstance(p, Future) else p
                                    for p in self.parts])
            self.parts = []
        return self._done


def chain(pendings: list[PendingScores]) -> PendingScores:
    """The scores of consecutive slices of one batch, submitted one after another, as one
    pending batch (`concat_scores` of the slices' scores). Its blocking time is the slices'
    sum; its overlap spans from the first slice's return to the last slice's scores."""
    if len(pendings) == 1:
        return pendings[0]
    return PendingScores([p for pend in pendings for p in pend.parts], _SliceJoin(pendings),
                         returned=pendings[0].returned,
                         blocked=sum(p.blocked for p in pendings))


class _SliceJoin:
    """Joins each slice's parts with the slice's own join, then concatenates the slices."""

    def __init__(self, pendings: list[PendingScores]) -> None:
        self.sizes = [len(p.parts) for p in pendings]
        self.joins = [p.join for p in pendings]

    def __call__(self, results: list[Scores]) -> Scores:
        out, i = [], 0
        for n, join in zip(self.sizes, self.joins, strict=True):
            out.append(join(results[i:i + n]))
            i += n
        return concat_scores(out)


def concat_scores(parts: list[Scores]) -> Scores:
    """Scores of consecutive slices of a batch as one: tensors concatenated in order; metrics
    merged as `Scores.gauges` says (`reward/*` means weighted by the slices' sizes, gauges by
    max, every other key added)."""
    sizes = [len(p.rewards) for p in parts]
    n = max(sum(sizes), 1)
    gauges = frozenset().union(*(p.gauges for p in parts))
    metrics: dict[str, float] = {}
    for p, size in zip(parts, sizes, strict=True):
        for key, v in p.metrics.items():
            if key in gauges:
                metrics[key] = max(metrics.get(key, v), v)
            elif key.startswith("reward/"):
                metrics[key] = metrics.get(key, 0.0) + v * size / n
            else:
                metrics[key] = metrics.get(key, 0.0) + v
    valid = (torch.cat([p.valid.bool() if p.valid is not None
                        else torch.ones(len(p.rewards), dtype=torch.bool) for p in parts])
             if any(p.valid is not None for p in parts) else None)
    return Scores(rewards=torch.cat([p.rewards.to(torch.float32) for p in parts]),
                  per_term={k: torch.cat([p.per_term[k] for p in parts])
                            for k in parts[0].per_term},
                  correct=torch.cat([p.correctness() for p in parts]), metrics=metrics,
                  valid=valid, gauges=gauges)


def all_of(parts: list[Scores | Future[Scores]],
           join: Callable[[list[Scores]], Scores]) -> Scores | Future[Scores]:
    """`join` of the parts: at once when none is a future, else a future completed (by the
    last part's callback, no thread of its own) with the join or the first part's exception."""
    futures = [p for p in parts if isinstance(p, Future)]
    if not futures:
        return join(parts)  # type: ignore[arg-type]
    out: Future[Scores] = Future()
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Future) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        try:
            out.set_result(join([p.result() if isinstance(p, Future) else p for p in parts]))
        except BaseException as e:  # noqa: BLE001 - handed to whoever awaits `out`
            out.set_exception(e)

    for f in futures:
        f.add_done_callback(one_done)
    return out


def empty_scores() -> Scores:
    return Scores(rewards=torch.zeros(0), correct=torch.zeros(0, dtype=torch.bool))
