"""Rewards: the `RewardSource` seam and the component the collector scores through.

- sample.py: `Sample`, what a source scores (prompt, completion or trajectory, data record).
- source.py: the `RewardSource` protocol (`score(samples) -> Scores` or a future of them), the
  registry (`reward.source` names a source) and `PendingScores`.
- rules.py: the rule functions (math, exact match, format, `module:function`) and their resolver.
- terms.py: the `rules` source, a weighted sum of rule terms under deadlines.
- isolation.py: the deadline machinery (threads, a killable process pool).
- environment.py: a trajectory's per-turn environment rewards, joined through the same seam.
- remote.py: the `remote` source, an HTTP endpoint (batched JSON, timeouts, bounded retries,
  a concurrency limit).
- reward_model.py: the `reward_model` source, an HF sequence-classification model, batched.
- judge.py: the `judge` source, a generative LLM judge on the rollout engine (template, regex).
- combine.py: `reward.sources`, several sources summed with weights.
- options.py: a source's options read into its dataclass, errors naming the field.

`build_rewards` is called once at set-up; the collector calls `Rewards.submit(samples)` and
awaits the handle when it gathers the batch.
"""
from __future__ import annotations

import time

import torch

from megagrpo.config.data import RewardConfig
from megagrpo.reward.combine import WeightedSources
from megagrpo.reward.environment import EnvironmentRewards
from megagrpo.reward.isolation import call_with_deadline, stuck_reward_threads
from megagrpo.reward.rules import (
    BUILTIN_REWARDS,
    check_reward_kwargs,
    exact_match_reward,
    format_reward,
    math_reward,
    normalize_answer,
    resolve_reward,
    resolve_terms,
)
from megagrpo.reward.sample import Sample, samples_of
from megagrpo.reward.source import (
    PendingScores,
    RewardContext,
    RewardSource,
    Scores,
    build_source,
    chain,
    concat_scores,
    empty_scores,
    register_source,
    source_builder,
)
from megagrpo.reward.source import check_source as _check_one
from megagrpo.reward.terms import RuleTerms

__all__ = [
    "BUILTIN_REWARDS", "EnvironmentRewards", "PendingScores", "RewardSource", "Rewards",
    "RuleTerms", "Sample", "Scores", "build_rewards", "call_with_deadline", "check_reward_kwargs",
    "check_source", "exact_match_reward", "format_reward", "math_reward", "normalize_answer",
    "register_source", "resolve_reward", "resolve_terms", "samples_of", "stuck_reward_threads",
    "RewardContext", "WeightedSources", "chain", "concat_scores",
]


class Rewards:
    """The reward component: the configured source, plus the environment's per-turn rewards
    when trajectories carry them. Totals add in that order; `correct` is the source's."""

    def __init__(self, source: RewardSource, environment: EnvironmentRewards | None = None
                 ) -> None:
        self.source = source
        self.environment = environment

    def submit(self, samples: list[Sample]) -> PendingScores:
        """Starts scoring (a synchronous source scores here); `result()` on the handle waits."""
        if not samples:
            return PendingScores([empty_scores()], _first)
        start = time.perf_counter()
        parts = [self.source.score(samples)]
        if self.environment is not None:
            parts.append(self.environment.score(samples))
        return PendingScores(parts, _join, submitted=start)

    def score(self, samples: list[Sample]) -> Scores:
        """`submit(samples).result()`."""
        return self.submit(samples).result()

    def close(self) -> None:
        self.source.close()


def build_rewards(cfg: RewardConfig, env_reward: str = "none",
                  context: RewardContext | None = None) -> Rewards:
    """The reward component from the `reward` section (checked: `RewardConfig.validate`);
    `env_reward` is agent.env_reward where multi-turn rollouts run ('none' otherwise);
    `context` (the engine, the tokenizer) for sources that need it (the judge)."""
    source = (WeightedSources.build(cfg, context) if cfg.sources
              else build_source(source_builder(cfg.source), cfg, context))
    return Rewards(source, EnvironmentRewards(env_reward) if env_reward != "none" else None)


def check_source(cfg: RewardConfig) -> None:
    """Preflight: the configured source (or each of `reward.sources`) resolves and accepts its
    options; errors name the field. Nothing is scored or loaded."""
    if cfg.sources:
        WeightedSources.check(cfg)
    else:
        _check_one(cfg)


def _first(parts: list[Scores]) -> Scores:
    return parts[0]


def _join(parts: list[Scores]) -> Scores:
    """The source's scores with the environment's added: rewards summed, per-term and metrics
    merged, correctness the source's."""
    head, *rest = parts
    out = Scores(rewards=head.rewards.to(torch.float32), per_term=dict(head.per_term),
                 correct=head.correctness(), metrics=dict(head.metrics), valid=head.valid,
                 gauges=head.gauges)
    for p in rest:
        out.rewards = out.rewards + p.rewards.to(out.rewards.dtype)
        out.per_term.update(p.per_term)
        out.metrics.update(p.metrics)
        out.gauges = out.gauges | p.gauges
    return out
