"""megatron-core DDP + optimizer + the forward/backward schedule, wrapped for the trainer.

The step follows megatron-core's minimal loop: zero_grad -> forward_backward_func (1F1B under
PP) -> finalize grads (DP all-reduce, tied-embedding all-reduce across stages) -> optimizer step.

Without Transformer Engine or Apex (every CPU run) megatron-core steps torch's `AdamW` built with
its defaults, which on CPU tensors is the per-parameter loop (about a dozen small ops per
parameter); `use_fused_adam` switches it to torch's fused kernel (one pass per parameter, every
moment update in registers): a 12.6M-parameter model's step 78 -> 6.5 ms on 2 cores. The same
update rule, rounded differently (tests/test_optim.py checks both against float64 AdamW).
"""
from __future__ import annotations

import math
from typing import Callable, Iterable

import torch

from megagrpo.config.optim import OptimConfig
from megagrpo.runtime.cpu_compat import megatron_scope


def lr_at(cfg: OptimConfig, step: int, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    span = max(1, total_steps - cfg.warmup_steps)
    frac = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * frac))


@megatron_scope()
def wrap_ddp(gpt: torch.nn.Module, cfg: OptimConfig) -> torch.nn.Module:
    """megatron DDP around one model stage (grad buffers, DP reduce)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False,
        use_distributed_optimizer=cfg.distributed_optimizer,
    )
    return DistributedDataParallel(config=gpt.config, ddp_config=ddp_cfg, module=gpt)


@megatron_scope()
def build_optimizer(ddp_model: torch.nn.Module, cfg: OptimConfig):
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = ddp_model.module.config
    dtype = config.params_dtype
    fp16 = dtype == torch.float16
    ocfg = OptimizerConfig(
        optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad, bf16=dtype == torch.bfloat16, fp16=fp16,
        params_dtype=dtype, use_distributed_optimizer=cfg.distributed_optimizer,
        **(loss_scaling(cfg) if fp16 else {}),
    )
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(ocfg, [ddp_model])
    # megatron's schedule multiplies the last stage's loss by grad_scale_func before backward
    # (megatron-LM's training loop sets it); its fp16 optimizer divides the main grads by the
    # same scale in prepare_grads. Without it the fp16 grads would be unscaled by 1/scale.
    config.grad_scale_func = optimizer.scale_loss if loss_scale(optimizer) is not None else None
    use_fused_adam(optimizer)
    return optimizer


def loss_scaling(cfg: OptimConfig) -> dict:
    """megatron's OptimizerConfig fields of the fp16 loss scaler: a ConstantGradScaler for
    optim.loss_scale > 0, else a DynamicGradScaler (halves on overflow, doubles after a window
    of clean steps)."""
    return {"loss_scale": cfg.loss_scale or None, "initial_loss_scale": cfg.initial_loss_scale,
            "min_loss_scale": cfg.min_loss_scale, "loss_scale_window": cfg.loss_scale_window,
            "hysteresis": cfg.loss_scale_hysteresis}


def scaler_can_back_off(optimizer) -> bool:
    """Whether an fp16 overflow now is the dynamic scaler probing (it will lower the scale:
    its scale is above min_loss_scale) rather than a gradient that is not finite at any scale
    (a constant scaler, or a dynamic one already at its floor)."""
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler

    return any(isinstance(s, DynamicGradScaler) and bool(s.scale.item() > s.min_scale.item())
               for s in (getattr(o, "grad_scaler", None)
                         for o in getattr(optimizer, "chained_optimizers", [optimizer])))


def loss_scale(optimizer) -> float | None:
    """The fp16 loss scale the next backward multiplies the loss by; None without a scaler
    (fp32, bf16)."""
    scalers = [o.grad_scaler for o in getattr(optimizer, "chained_optimizers", [optimizer])
               if getattr(o, "grad_scaler", None) is not None]
    return float(scalers[0].scale.item()) if scalers else None


FUSED_ADAM_DEVICES = ("cpu", "cuda")


def torch_adams(optimizer) -> list[torch.optim.Optimizer]:
    """The torch Adam/AdamW instances inside megatron's (chained) optimizer; [] when it steps
    Transformer Engine's or Apex's fused Adam."""
    inners = getattr(optimizer, "chained_optimizers", [optimizer])
    found = [getattr(o, "optimizer", o) for o in inners]
    return [o for o in found if type(o) in (torch.optim.Adam, torch.optim.AdamW)]


def adam_footprint(optimizer) -> tuple[int, int]:
    """What the torch Adams inside `optimizer` hold: (elements of the parameters they step,
    bytes of their state tensors: the moments, not the 0-dim step counters)."""
    adams = torch_adams(optimizer)
    numel = sum(p.numel() for o in adams for g in o.param_groups for p in g["params"])
    state = sum(t.numel() * t.element_size() for o in adams for s in o.state.values()
                for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    return numel, state


def use_fused_adam(optimizer) -> bool:
    """Makes every torch Adam(W) in `optimizer` step with torch's fused kernel where all its
    parameters are floating point on a device that has one. Called after building and after
    loading a checkpoint (`load_state_dict` takes the param groups' flags from the saved
    groups). Returns whether any torch Adam steps fused now."""
    fused = False
    for opt in torch_adams(optimizer):
        params = [p for g in opt.param_groups for p in g["params"]]
        if params and all(p.device.type in FUSED_ADAM_DEVICES and p.is_floating_point()
                          for p in params):
            for group in opt.param_groups:
                group["fused"], group["foreach"] = True, False
            opt.defaults.update(fused=True, foreach=False)
            fused = True
    return fused


def _moments(opt, param: torch.nn.Parameter) -> tuple[dict, slice | None] | None:
    """(torch Adam's state of `param` in megatron optimizer `opt`, the flat range of `param` it
    covers, None for all) or None where `opt` holds no state for it. The distributed optimizer
    keys a shard of the flat parameter (its own range), the float16 one an fp32 main copy
    (`param.main_param`), the fp32 one the parameter itself."""
    inner = opt if isinstance(opt, torch.optim.Optimizer) else getattr(opt, "optimizer", None)
    if inner is None:
        return None
    index = getattr(opt, "model_param_group_index_map", None)
    if index is not None:
        if param not in index:
            return None
        gi, go = index[param]
        rng = opt._get_model_param_range_map(param)["param"]
        state = inner.state.get(inner.param_groups[gi]["params"][go])
        return (state, slice(rng.start, rng.end)) if state else None
    main = getattr(param, "main_param", None)
    state = inner.state.get(param if main is None else main)
    return (state, None) if state else None


@torch.no_grad()
def scale_adam_moments(optimizer, scales: dict[torch.nn.Parameter, torch.Tensor]) -> int:
    """Adam's moments of each parameter p in `scales` as if its past gradients had been
    scaled by c = scales[p] (broadcast to p's shape): exp_avg *= c, exp_avg_sq *= c^2. Adam's
    step is invariant to a gradient scale, so after an edit that scales p's gradient by c
    (a LoRA merge's B *= 1 - alpha scales A's) its next steps match the unscaled run's, where
    keeping the moments would take steps off by c (stale momentum at c = 0). Parameters this
    rank holds no state for (not stepped yet; the distributed optimizer's other shards) are
    skipped. Returns how many moment pairs were scaled."""
    n = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for p, c in scales.items():
            found = _moments(opt, p)
            if found is None or "exp_avg" not in found[0]:
                continue
            state, rng = found
            c = c.to(torch.float64).expand(p.shape).reshape(-1)
            c = c if rng is None else c[rng]
            for key, power in (("exp_avg", 1), ("exp_avg_sq", 2)):
                t = state[key]
                t.copy_((t.double() * c.reshape(t.shape) ** power).to(t.dtype))
            n += 1
    return n


def set_lr(optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr


@megatron_scope()
def forward_backward(
    ddp_model: torch.nn.Module,
    forward_step: Callable,
    microbatches: Iterable,
    num_microbatches: int,
    *,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool = False,
) -> list:
    """Runs megatron's schedule (no pipelining, or 1F1B under PP) over the micro-batches.
    `forward_step(batch, model) -> (output, loss_fn)` as in megatron-core; returns the loss
    functions' reports on the last stage (empty list elsewhere)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    it = iter(microbatches)
    fb = get_forward_backward_func()

    def step(data_iterator, model):
        return forward_step(next(data_iterator), model)

    return fb(
        forward_step_func=step, data_iterator=it, model=[ddp_model],
        num_microbatches=num_microbatches, seq_length=seq_length,
        micro_batch_size=micro_batch_size, forward_only=forward_only,
    )


@megatron_scope()
def optimizer_step(ddp_model: torch.nn.Module, optimizer) -> tuple[bool, float]:
    """Applies the accumulated grads unless their norm is not finite. Returns (applied,
    grad_norm).

    megatron skips a step on inf/NaN only for fp16 (its grad scaler's found_inf after dividing
    the main grads by the loss scale; the scaler halves or grows the scale); in fp32/bf16
    it clips by clip_grad / inf = 0, which turns inf grads into NaN weights and still moves
    Adam's moments. So the norm (all-reduced over the model-parallel group, the same on every
    rank) is checked first and a non-finite one leaves weights and optimizer state untouched."""
    norm = 0.0
    if loss_scale(optimizer) is None:
        # fp16 keeps megatron's check: a second prepare_grads would update the scaler twice
        optimizer.prepare_grads()  # main grads -> .grad, where the norm reads them
        norm = float(optimizer.get_grad_norm() or 0.0)
        if not math.isfinite(norm):
            return False, norm
    ok, grad_norm, _ = optimizer.step()
    return bool(ok), float(grad_norm) if grad_norm is not None else norm


@megatron_scope()
def zero_grad(ddp_model: torch.nn.Module, optimizer) -> None:
    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()


__all__ = ["OptimConfig", "lr_at", "wrap_ddp", "build_optimizer", "set_lr", "forward_backward",
           "optimizer_step", "zero_grad", "scale_adam_moments", "loss_scale", "loss_scaling",
           "scaler_can_back_off"]
