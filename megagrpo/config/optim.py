"""Optimizer and learning-rate schedule."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class OptimConfig:
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
        if self.lr <= 0:
            raise ValueError(f"optim.lr={self.lr} must be > 0")
        if self.lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"optim.lr_schedule={self.lr_schedule!r}: use constant or cosine")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps={self.warmup_steps} must be >= 0")
