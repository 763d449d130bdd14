"""Several reward sources in one recipe (`reward.sources`): each scores the whole batch, their
rewards are summed with the recipe's weights. Each source's raw reward is a per-term value and
a metric under its label (`reward/<label>`); its own per-term values and metrics are kept,
prefixed `<label>/` where two sources would use the same key. Sources that answer with a future
run concurrently: the combination is a future that completes when the last of them does."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from megagrpo.config.data import RewardConfig
from megagrpo.reward.options import WHERE
from megagrpo.reward.sample import Sample
from megagrpo.reward.source import (
    RewardContext,
    RewardSource,
    Scores,
    all_of,
    build_source,
    source_builder,
)


@dataclass
class Part:
    """One source of the combination."""

    label: str
    weight: float
    source: RewardSource


def part_config(cfg: RewardConfig, i: int) -> RewardConfig:
    """The `RewardConfig` source i is built with: the section, its source and options."""
    s = cfg.sources[i]
    return dataclasses.replace(cfg, source=s.source, options=dict(s.options), sources=[])


def labels(cfg: RewardConfig) -> list[str]:
    """Each source's label: its `label`, else its name, '#k' from the 2nd occurrence on."""
    seen: dict[str, int] = {}
    out = []
    for s in cfg.sources:
        name = s.label or s.source
        k = seen.get(name, 0)
        seen[name] = k + 1
        out.append(name if k == 0 else f"{name}#{k}")
    return out


def each_source(cfg: RewardConfig, fn: Callable[[Callable, RewardConfig], object]) -> list:
    """`fn(builder, part config)` for every source, errors naming `reward.sources[i]`."""
    out = []
    for i, s in enumerate(cfg.sources):
        where = f"reward.sources[{i}]"
        try:
            out.append(fn(source_builder(s.source), part_config(cfg, i)))
        except ValueError as e:
            msg = str(e).replace(f"{WHERE}.", f"{where}.options.").replace(
                "reward.source=", f"{where}.source=")
            raise ValueError(msg if where in msg else f"{where} ({s.source}): {msg}") from None
    return out


class WeightedSources:
    """The `reward.sources` combination: sum of weight x each source's reward."""

    def __init__(self, parts: list[Part], correctness: int = 0) -> None:
        if len({p.label for p in parts}) != len(parts):
            raise ValueError(f"reward.sources[].label: labels repeat ({[p.label for p in parts]})")
        self.parts, self.correctness = parts, correctness

    @classmethod
    def build(cls, cfg: RewardConfig, context: RewardContext | None = None) -> WeightedSources:
        sources = each_source(cfg, lambda builder, sub: build_source(builder, sub, context))
        marked = [i for i, s in enumerate(cfg.sources) if s.correctness]
        return cls([Part(label, s.weight, src) for label, s, src
                    in zip(labels(cfg), cfg.sources, sources, strict=True)],
                   correctness=marked[0] if marked else 0)

    @staticmethod
    def check(cfg: RewardConfig) -> None:
        """Preflight: every source resolves and accepts its options."""
        each_source(cfg, lambda builder, sub: getattr(builder, "check", _no_check)(sub))

    def score(self, samples: list[Sample]) -> Scores | Future[Scores]:
        return all_of([p.source.score(samples) for p in self.parts], self.join)

    def join(self, scores: list[Scores]) -> Scores:
        n = len(scores[0].rewards)
        total = torch.zeros(n, dtype=torch.float32)
        valid = torch.ones(n, dtype=torch.bool)
        per_term: dict[str, torch.Tensor] = {}
        metrics: dict[str, float] = {}
        gauges: set[str] = set()
        for part, s in zip(self.parts, scores, strict=True):
            raw = s.rewards.to(torch.float32)
            total += part.weight * raw
            if s.valid is not None and part.weight != 0:  # a weight-0 source only watches
                valid &= s.valid.bool()
            ok = _scored(s)
            per_term[part.label] = raw
            metrics[f"reward/{part.label}"] = float(raw[ok].mean()) if bool(ok.any()) else 0.0
            for key, v in s.per_term.items():
                per_term[key if key not in per_term else f"{part.label}/{key}"] = v
            for key, v in s.metrics.items():
                name = key if key not in metrics else f"{part.label}/{key}"
                metrics[name] = v
                if key in s.gauges:
                    gauges.add(name)
        head = scores[self.correctness]
        metrics.update(agreement(self.parts, scores, self.correctness))
        return Scores(rewards=total, per_term=per_term, correct=head.correctness(),
                      metrics=metrics, valid=None if bool(valid.all()) else valid,
                      gauges=frozenset(gauges))

    def close(self) -> None:
        for p in self.parts:
            p.source.close()


AGREEMENT = ("both", "head_only", "source_only", "neither")
"""`agreement/<label>/<cell>` counts: samples both sources scored, by whether the correctness
source (`head`) and source `<label>` called them correct."""


def agreement(parts: list[Part], scores: list[Scores], head: int) -> dict[str, float]:
    """For each source that says which samples are correct (`Scores.correct`, e.g. a judge's
    `correct_at`), other than the correctness source, the 2x2 counts of its verdicts against
    the correctness source's over the samples both scored. Counts, so slices and ranks add."""
    ref = scores[head]
    out: dict[str, float] = {}
    for i, (part, s) in enumerate(zip(parts, scores, strict=True)):
        if i == head or s.correct is None:
            continue
        both = _scored(ref) & _scored(s)
        a, b = ref.correctness()[both], s.correctness()[both]
        for cell, hit in zip(AGREEMENT, (a & b, a & ~b, ~a & b, ~a & ~b), strict=True):
            out[f"agreement/{part.label}/{cell}"] = float(hit.sum())
    return out


def _scored(s: Scores) -> torch.Tensor:
    return s.valid.bool() if s.valid is not None else torch.ones(len(s.rewards), dtype=torch.bool)


def _no_check(cfg: RewardConfig) -> None:
    pass
