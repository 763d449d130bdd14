"""Optimizer and learning-rate schedule."""
from __future__ import annotations

from dataclasses import dataclass

from megagrpo.config.section import Section


@dataclass(kw_only=True)
class OptimConfig(Section):
    """Optimizer and learning-rate schedule."""

    lr: float = 1e-5
    """Peak learning rate."""
    min_lr: float = 0.0
    """Floor of the cosine schedule."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global grad-norm clip (0 disables)."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    lr_schedule: str = "constant"
    """'constant' or 'cosine' (after warm-up, to min_lr at total steps)."""
    distributed_optimizer: bool = False
    """Shard optimizer state over DP ranks (megatron's distributed optimizer)."""

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field and what would be valid."""
        if self.lr <= 0:
            raise ValueError(f"optim.lr={self.lr} must be > 0")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"optim.min_lr={self.min_lr}: need 0 <= min_lr <= optim.lr="
                             f"{self.lr} (the cosine schedule decays from lr down to min_lr)")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"optim.{name}={getattr(self, name)}: need 0 <= beta < 1 "
                                 "(e.g. 0.9 and 0.999)")
        if self.adam_eps <= 0:
            raise ValueError(f"optim.adam_eps={self.adam_eps}: need > 0 (e.g. 1e-8); 0 divides "
                             "by zero for parameters whose gradient is zero")
        for name in ("weight_decay", "clip_grad"):
            if getattr(self, name) < 0:
                raise ValueError(f"optim.{name}={getattr(self, name)}: need >= 0 (0 disables)")
        if self.lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"optim.lr_schedule={self.lr_schedule!r}: use constant or cosine")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps={self.warmup_steps} must be >= 0")
