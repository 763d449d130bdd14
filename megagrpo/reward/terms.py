"""The `rules` reward source: a weighted sum of rule terms (`megagrpo.reward.rules`) over each
sample's completion text and answer, every call under a deadline (`megagrpo.reward.isolation`).
An exception, a timeout or a non-finite value scores 0 and counts in the metrics
(`reward_errors`, `reward_timeouts`): scoring never raises.

Isolation (reward.isolation): 'thread' (default; once `max_stuck_threads` abandoned calls are
still running the run switches to processes for good: one warning, metric
`reward_process_isolation`), 'process' (a killable worker pool) or 'none' (direct calls, no
deadline).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch
from torch import Tensor

from megagrpo.config.data import RewardConfig
from megagrpo.reward.isolation import ProcessScorer, call_with_deadline, stuck_reward_threads
from megagrpo.reward.rules import RewardCallable, resolve_terms
from megagrpo.reward.sample import Sample
from megagrpo.reward.source import Scores, register_source

log = logging.getLogger("megagrpo")

GAUGES = frozenset({"reward_stuck_threads", "reward_pool_restarts", "reward_process_isolation"})
"""Metrics that are levels of the process, not amounts of a batch."""


@register_source("rules")
class RuleTerms:
    """Weighted sum of reward terms built from a `RewardConfig` (the `rules` source)."""

    @staticmethod
    def check(cfg: RewardConfig) -> None:
        """Preflight: every term resolves and accepts its kwargs (errors name the term)."""
        resolve_terms(cfg)

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

    def score(self, samples: list[Sample]) -> Scores:
        """The samples' completion texts against their answers (synchronous)."""
        total, per_term, metrics = self.score_texts([s.completion for s in samples],
                                                    [s.answer for s in samples])
        return Scores(rewards=total, per_term=per_term, correct=self.correct(per_term).bool(),
                      metrics=metrics, gauges=GAUGES)

    def score_texts(
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
