"""The `environment` reward source: a multi-turn trajectory's per-turn environment rewards,
joined as agent.env_reward says ('sum' all turns, 'last' the final turn's, 'none' nothing).
The reward component adds it to the configured source's rewards when the agent is on."""
from __future__ import annotations

import torch

from megagrpo.reward.sample import Sample
from megagrpo.reward.source import Scores

LABEL = "environment"
"""Its per-term label (and the metric `reward/environment`)."""


def join_turn_rewards(turn_rewards: list[float] | None, mode: str) -> float:
    """One trajectory's environment reward from its per-turn rewards."""
    if not turn_rewards or mode == "none":
        return 0.0
    return float(sum(turn_rewards)) if mode == "sum" else float(turn_rewards[-1])


class EnvironmentRewards:
    """Scores each sample by its environment's per-turn rewards (single-turn samples: 0)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def score(self, samples: list[Sample]) -> Scores:
        values = torch.tensor([join_turn_rewards(s.turn_rewards, self.mode) for s in samples],
                              dtype=torch.float32)
        return Scores(rewards=values, per_term={LABEL: values},
                      metrics={f"reward/{LABEL}": float(values.mean()) if len(values) else 0.0})

    def close(self) -> None:
        pass
