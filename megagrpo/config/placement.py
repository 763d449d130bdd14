"""Config checks of rollout.placement (megagrpo.rollout.placement runs it): how many of the world's
ranks train. No torch here: the launcher imports it. (Separate placement refuses no other
section any more: what it does not run is refused where that feature is checked.)"""
from __future__ import annotations

from megagrpo.config.rollout import RolloutConfig


def training_world(rollout: RolloutConfig, world_size: int | None) -> int | None:
    """The ranks that train: the world less the rollout ranks under separate placement."""
    if world_size is None or rollout.placement != "separate":
        return world_size
    if world_size <= rollout.rollout_ranks:
        raise ValueError(f"rollout.rollout_ranks={rollout.rollout_ranks} leaves no training rank "
                         f"in a world of {world_size}: launch parallel.tp x pp x dp + "
                         f"{rollout.rollout_ranks} processes")
    return world_size - rollout.rollout_ranks


__all__ = ["training_world"]
