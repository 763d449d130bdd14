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
    loss_scale: float = 0.0
    """model.dtype=float16 only: a constant loss scale (e.g. 1024), or 0 for megatron's dynamic
    scaler (below). The loss is multiplied by the scale before backward, so that small fp16
    gradients do not flush to zero, and the gradients are divided by it in fp32 before the
    step. A step whose scaled gradients overflow (inf/NaN) is skipped: metric
    loss_scale_overflows while the dynamic scaler can still lower its scale, else
    nonfinite_grad (which counts towards run.max_bad_steps)."""
    initial_loss_scale: float = 65536.0
    """Dynamic loss scaling (model.dtype=float16, optim.loss_scale=0): the first scale (2^16, as
    torch's GradScaler; from megatron's own default, 2^32, reaching 2^16 skips 32 steps: 16
    halvings of 2 overflows each at the default hysteresis)."""
    min_loss_scale: float = 1.0
    """Dynamic loss scaling: the scale is never halved below this."""
    loss_scale_window: int = 1000
    """Dynamic loss scaling: the scale doubles after this many steps without an overflow."""
    loss_scale_hysteresis: int = 2
    """Dynamic loss scaling: consecutive overflowing steps before the scale halves (each one is
    skipped); 1 halves at the first."""

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
        self._validate_loss_scale()

    def _validate_loss_scale(self) -> None:
        if not 0 <= self.loss_scale < float("inf"):
            raise ValueError(f"optim.loss_scale={self.loss_scale}: need a finite scale >= 0 "
                             "(0 = dynamic loss scaling, e.g. 1024 = constant)")
        if not 0 < self.min_loss_scale <= self.initial_loss_scale < float("inf"):
            raise ValueError(f"optim.initial_loss_scale={self.initial_loss_scale} and "
                             f"optim.min_loss_scale={self.min_loss_scale}: need 0 < "
                             "min_loss_scale <= initial_loss_scale < inf (e.g. 1 and 65536)")
        for name in ("loss_scale_window", "loss_scale_hysteresis"):
            if getattr(self, name) < 1:
                raise ValueError(f"optim.{name}={getattr(self, name)} must be >= 1 (defaults: "
                                 "loss_scale_window=1000, loss_scale_hysteresis=2)")

    def check_dtype(self, dtype: str) -> None:
        """Loss scaling exists for float16 only: a constant scale set for another model.dtype
        would be silently ignored by megatron's fp32/bf16 optimizers, so it is refused."""
        if self.loss_scale and dtype != "float16":
            raise ValueError(f"optim.loss_scale={self.loss_scale} with model.dtype={dtype!r}: "
                             "loss scaling applies to model.dtype=float16 only (bf16 has fp32's "
                             "exponent range); set optim.loss_scale=0")
