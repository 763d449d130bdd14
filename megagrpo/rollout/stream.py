"""The rollout stream: what the trainer pulls its batches from, and how stale they may be.

A `RolloutSource` hands the trainer one batch of finished groups per step (`next(version)`),
every sample stamped with the policy version that sampled it (`Completion.version`). Its bound
is k = rollout.max_staleness (`TrainConfig.staleness`; run.async_rollout: true is k = 1):

- k = 0, colocated-sync: the batch is drawn when the step asks, by the weights that train it;
- k >= 1, colocated-async: the engines on the training ranks draw on a side thread while a step
  trains, keeping up to k batches queued, so the batch a step takes was sampled k versions
  back at most (`megagrpo.rollout.collect.RolloutCollector` is both);
- separate placement (rollout.placement=separate,
  `megagrpo.rollout.separate_source.SeparateSource`): rollout ranks of their own feed finished
  groups through the store; the same protocol, so the trainer does not change (docs/async.md).

Colocated pipelining bounds the lag by construction; the trainer still checks every sample
against k (`over_stale`) and drops or down-weights those beyond it (rollout.stale_policy), as a
stream fed by other ranks can exceed it. What a stream reports per step (`StreamStats`): the
queue depth, the time it spent sampling, and from the trainer's phases the time the trainer
waited for samples (docs/metrics.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from megagrpo.engine.columns import SampleColumns, int_column
from megagrpo.engine.types import model_versions

if TYPE_CHECKING:
    from megagrpo.engine import Completion


@dataclass
class Rollout:
    """A replica's sampled batch (identical on its TP x CP x PP ranks)."""

    prompts: list[list[int]]
    """[B] prompt token ids."""
    answers: list[str]
    """[B] reference answers."""
    completions: list[Completion] | SampleColumns = field(default_factory=list)
    """[B*G] `Completion`s, prompt-major (separate placement: as columns, read-only)."""
    rewards: torch.Tensor | None = None
    """[B*G] summed rewards."""
    version: int = 0
    """Optimizer steps the sampling policy had taken (of the first draw; each completion
    records its own in `Completion.version`)."""
    epoch: int = 0
    """Data epoch of the prompts."""
    metrics: dict = field(default_factory=dict)
    """Reward-term and sampling scalars (per replica)."""
    images: list | None = None
    """A vision-language model: [B] each prompt's (pixel_values, image_grid_thw) or None;
    `prompts` are then the expanded ids (None: a text model)."""


@dataclass
class StreamStats:
    """What a source did for one step (read after `join`)."""

    queue_depth: int = 0
    """Batches drawn ahead and waiting when the step asked for one (0: drawn on demand)."""
    draw_s: float = 0.0
    """Wall seconds spent sampling and scoring this step's draws, on either thread."""


@runtime_checkable
class RolloutSource(Protocol):
    """What the trainer pulls batches from (docs/architecture.md; DESIGN 'RolloutSource')."""

    stats: StreamStats
    """The current step's figures."""

    def next(self, version: int) -> Rollout:
        """This step's batch; `version` is the policy version the engines hold. Every
        completion's `version` says which policy sampled it."""
        ...

    def join(self) -> None:
        """Collective: waits for the draws started by `next` (a no-op when none run)."""
        ...

    def ahead_loader_states(self) -> list[dict]:
        """The loader position before each batch drawn ahead and not yet trained (oldest
        first): where a resume that cannot restore those batches finds their prompts."""
        ...

    def return_batches(self, loader_states: list[dict]) -> None:
        """Gives the prompts of batches drawn ahead but not restored back, to be drawn first."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def sample_versions(ro: Rollout) -> torch.Tensor:
    """[n] int64 the policy version of each completion (the batch's where none was stamped)."""
    v = int_column(ro.completions, "version")
    return torch.where(v >= 0, v, ro.version)


def sample_lags(ro: Rollout, trainer_version: int) -> torch.Tensor:
    """[n] int64 optimizer updates between each completion's sampling policy and the trainer."""
    return trainer_version - sample_versions(ro)


def over_stale(lags: torch.Tensor, k: int) -> torch.Tensor:
    """[n] bool: the samples more than k versions old."""
    return lags > k


def stale_weights(lags: torch.Tensor, k: int) -> torch.Tensor:
    """[n] float32 loss scale under rollout.stale_policy=weight: (k + 1) / (lag + 1) beyond the
    bound (1 at lag = k, halved at lag = 2k + 1), 1 within it."""
    scale = (k + 1) / (lags.clamp(min=0).double() + 1)
    return torch.where(lags > k, scale, 1.0).float()


def stamp(completions: list[Completion], version: int) -> None:
    """Records the sampling policy's version on freshly drawn completions: `version`, or with
    in-flight updates or partial rollouts the oldest version among its model's tokens
    (`Completion.token_versions`; an environment's tokens carry none)."""
    for c in completions:
        own = model_versions(c)
        c.version = min(own) if own else version


__all__ = ["Rollout", "RolloutSource", "StreamStats", "over_stale", "sample_lags",
           "sample_versions", "stale_weights", "stamp"]
