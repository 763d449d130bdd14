"""Config checks of rollout.placement (megagrpo.placement runs it): how many of the world's
ranks train, and what separate placement refuses. No torch here: the launcher imports it."""
from __future__ import annotations

from typing import TYPE_CHECKING

from megagrpo.config.rollout import RolloutConfig

if TYPE_CHECKING:
    from megagrpo.config.train import TrainConfig


def training_world(rollout: RolloutConfig, world_size: int | None) -> int | None:
    """The ranks that train: the world less the rollout ranks under separate placement."""
    if world_size is None or rollout.placement != "separate":
        return world_size
    if world_size <= rollout.rollout_ranks:
        raise ValueError(f"rollout.rollout_ranks={rollout.rollout_ranks} leaves no training rank "
                         f"in a world of {world_size}: launch parallel.tp x pp x dp + "
                         f"{rollout.rollout_ranks} processes")
    return world_size - rollout.rollout_ranks


def check_separate(cfg: TrainConfig) -> None:
    """Raise ValueError for what separate placement does not run (yet), naming the field."""
    if cfg.rollout.placement != "separate":
        return
    refused = [
        (cfg.agent.enabled, "agent.environment", "multi-turn rollouts run colocated only"),
        (cfg.algo.dynamic_sampling, "algo.dynamic_sampling=true",
         "top-ups would need the trainer to ask the rollout ranks for more"),
        (cfg.eval.every > 0, f"eval.every={cfg.eval.every}",
         "the rollout ranks do not evaluate (set eval.every=0)"),
        (cfg.cold_start.steps > 0, f"cold_start.steps={cfg.cold_start.steps}",
         "the cold start evaluates on colocated engines (set cold_start.steps=0)"),
        (cfg.lora.enabled, "lora.rank > 0", "LoRA refits run colocated only"),
        (cfg.algo.routing_replay, "algo.routing_replay=true",
         "routes are not sent back from the rollout ranks"),
    ]
    for bad, name, why in refused:
        if bad:
            raise ValueError(f"{name} with rollout.placement=separate: {why}; use "
                             "rollout.placement=colocated for it")


__all__ = ["check_separate", "training_world"]
