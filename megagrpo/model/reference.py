"""The KL reference: a second GPTModel with the policy's TP/PP layout, and its schedule.

Because both models share the layout, every rank holds the reference shard that pairs with its
policy shard, so re-initialising the reference is a local in-place copy (or lerp) per parameter:
no gather, no reload, no new allocation. alpha=1 is DeepSeekMath's reset (Alg. 1, line 3);
alpha<1 is TRL-style mixing ref <- alpha*policy + (1-alpha)*ref.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import ClassVar

import torch

from megagrpo.config.model import ModelConfig, ParallelConfig
from megagrpo.config.train import ReferenceConfig
from megagrpo.model.gpt import build_model, unwrap

log = logging.getLogger("megagrpo")


@dataclass
class ReferenceState:
    """What the schedule remembers (saved in checkpoints so a resumed run keeps it)."""

    syncs: int = 0
    """Re-initialisations that mixed the policy in."""
    last_sync_step: int = 0
    """GRPO step of the last reset (mixed or not)."""
    last_epoch: int = 0
    """Data epoch of the last reset."""
    last_sync_version: int = -1
    """Policy version (optimizer updates) the reference was last mixed with; -1 = none since
    the start (checkpoints written before this field load with it)."""


def _pairs(ref: torch.nn.Module, policy: torch.nn.Module):
    rp, pp = list(unwrap(ref).named_parameters()), list(unwrap(policy).named_parameters())
    if [n for n, _ in rp] != [n for n, _ in pp]:
        raise RuntimeError("reference and policy parameter lists differ: layouts must match")
    for (name, r), (_, p) in zip(rp, pp):
        if r.shape != p.shape:
            raise RuntimeError(f"{name}: reference {tuple(r.shape)} != policy {tuple(p.shape)}")
        yield r, p


@torch.no_grad()
def sync_reference(ref: torch.nn.Module, policy: torch.nn.Module, alpha: float = 1.0) -> None:
    """ref <- alpha * policy + (1 - alpha) * ref, in place, shard by shard on this rank."""
    for r, p in _pairs(ref, policy):
        src = p.detach()
        if src.device != r.device:  # an offloaded reference
            src = src.to(r.device, non_blocking=True)
        if alpha == 1.0:
            r.copy_(src)
        else:
            r.lerp_(src.to(r.dtype), alpha)


class ReferenceSchedule:
    """When the reference is re-initialised (the schedule every reference shares); a subclass
    says how (`reinit`): `Reference` copies into a model of its own, `megagrpo.lora.
    LoRAReference` merges the adapters into the base."""

    cfg: ReferenceConfig
    state: ReferenceState
    separate_model: ClassVar[bool] = True
    """The reference is a model of its own (a checkpoint saves it); False: a view of the
    policy (LoRA's adapters off), whose reset edits the policy's parameters."""
    merges: int = 0
    """Resets merged into the policy's own weights so far (0 where the reference is a model of
    its own): which base a LoRA checkpoint holds."""

    def reinit(self, policy: torch.nn.Module, alpha: float = 1.0) -> None:
        raise NotImplementedError

    def due_before(self, epoch: int) -> str | None:
        """'epoch' when a batch of data epoch `epoch` is about to be scored and the reference
        is reset at every epoch's start and has not been in this epoch (DeepSeekMath Alg. 1:
        the reference is re-initialised before the iteration's first batch), else None."""
        if self.cfg.sync_every_epoch and epoch > self.state.last_epoch:
            return "epoch"
        return None

    def due_after(self, step: int, kl: float | None) -> str | None:
        """The reason to re-initialise after GRPO step `step` (1-based), or None."""
        c = self.cfg
        if c.sync_every_steps and step - self.state.last_sync_step >= c.sync_every_steps:
            return "steps"
        if c.sync_kl_threshold and kl is not None and kl > c.sync_kl_threshold:
            return "kl"
        return None

    def sync(self, policy: torch.nn.Module, step: int, epoch: int, *, version: int) -> bool:
        """A reset of the schedule after GRPO step `step` (epoch `epoch`) with the policy at
        `version`: mixes ref <- alpha * policy + (1 - alpha) * ref unless the reference was
        already mixed with this version (two schedules firing with no update between: a
        second mix would be alpha applied twice). Returns whether it mixed."""
        mix = version != self.state.last_sync_version
        if mix:
            self.reinit(policy, self.cfg.alpha)
        self.state = ReferenceState(syncs=self.state.syncs + int(mix), last_sync_step=step,
                                    last_epoch=epoch, last_sync_version=version)
        return mix

    def state_dict(self) -> dict:
        """The schedule's state (the weights are saved as a model checkpoint)."""
        return dataclasses.asdict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = ReferenceState(**state)


class Reference(ReferenceSchedule):
    """Owns the reference model, its offload and its re-initialisation schedule."""

    def __init__(self, policy: torch.nn.Module, model: ModelConfig, parallel: ParallelConfig,
                 cfg: ReferenceConfig, *, seed: int):
        self.cfg = cfg
        self.state = ReferenceState()
        self.model = build_model(model, parallel, seed=seed)
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.model.eval()
        sync_reference(self.model, policy, 1.0)
        self._offloaded = False
        if cfg.offload and not torch.cuda.is_available():
            log.info("reference.offload: no-op on CPU (the reference already lives in host memory)")
        self.offload()

    def reinit(self, policy: torch.nn.Module, alpha: float = 1.0) -> None:
        """ref <- alpha * policy + (1 - alpha) * ref (the schedule is untouched)."""
        self.onload()
        sync_reference(self.model, policy, alpha)
        self.offload()

    def equals(self, policy: torch.nn.Module, group=None) -> bool:
        """Whether every rank's reference shard is bitwise its policy shard (a reset with alpha
        1 and no optimizer step since), so its log-probs would equal the policy's. Stops at
        the first differing tensor; an offloaded reference is not compared (False). The same
        answer on every rank of `group` (None: the world)."""
        same = not self._offloaded and all(torch.equal(r, p) for r, p in _pairs(self.model,
                                                                                 policy))
        flag = torch.tensor([1.0 if same else 0.0])
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group)
        return bool(flag.item())

    def onload(self) -> None:
        """Moves an offloaded reference back to the accelerator (before scoring)."""
        if self._offloaded:
            dev = torch.device("cuda", torch.cuda.current_device())
            for p in self.model.parameters():
                p.data = p.data.to(dev, non_blocking=True)
            self._offloaded = False

    def offload(self) -> None:
        if self.cfg.offload and torch.cuda.is_available() and not self._offloaded:
            for p in self.model.parameters():
                p.data = p.data.to("cpu", non_blocking=True).pin_memory()
            self._offloaded = True
