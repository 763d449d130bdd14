"""Config checks of rollout.placement (megagrpo.rollout.placement runs it): how many of the world's
ranks train, and what separate placement refuses. No torch here: the launcher imports it."""
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


def check_separate(rollout: RolloutConfig, *, algo, lora) -> None:
    """Raise ValueError for what separate placement (`rollout`) does not run (yet), naming the
    field; the other arguments are the config's sections of those names."""
    if rollout.placement != "separate":
        return
    refused = [
        (lora.enabled and lora.refit == "adapter", "lora.refit=adapter",
         "the rollout ranks are sent the merged weights (adapter-only sync to them is not "
         "built yet): set lora.refit=auto or merged"),
    ]
    for bad, name, why in refused:
        if bad:
            raise ValueError(f"{name} with rollout.placement=separate: {why}; use "
                             "rollout.placement=colocated for it")


__all__ = ["check_separate", "training_world"]
