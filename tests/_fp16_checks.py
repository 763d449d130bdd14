"""fp16 loss scaling, checked inside tests/_bf16_worker.py's torchrun launch (2 ranks, TP=2,
after the bf16 trainer's checks, on the same process groups): megatron's fp16 model, DDP and
optimizer as `megagrpo.model.optim` builds them, without vLLM.

- gradients: one forward/backward of a token-mean cross-entropy times 2^-14 (the size of a
  loss normalised over ~10^4 tokens: its logit gradients sit at fp16's subnormal range), the
  fp32 main gradients after megatron's unscale vs a float64 copy of the same (fp16-rounded)
  weights; once with the default dynamic scale, once with optim.loss_scale=1 (no scaling);
- overflow: an initial scale of 2^24 overflows the fp16 backward; each such step is skipped
  (weights, fp32 main copies and Adam state untouched) and halves the scale (hysteresis 1),
  until a step applies; a scaler at its floor reports a non-finite gradient, not a probe;
- resume: the scaler's state (scale, growth and hysteresis trackers) survives
  save_optimizer -> load_optimizer into a freshly built optimizer.
Returns scalars for tests/test_bf16.py."""
from __future__ import annotations

import copy
from pathlib import Path

import torch

LOSS_SIZE = 2.0 ** -14
OVERFLOW_SCALE = 2.0 ** 24


def _ce_step(vocab: int, factor: float):
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    def fwd(batch, model):
        ids, labels = batch
        out = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)

        def loss_fn(o):
            logits = gather_from_tensor_model_parallel_region(o)[..., :vocab].float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab),
                                                     labels.reshape(-1)) * factor
            return loss, {"loss": loss.detach()}

        return out, loss_fn

    return fwd


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (4, 16), generator=g)
    return ids, torch.randint(0, vocab, (4, 16), generator=g)


def _fp16_policy(mcfg, parallel, optim_cfg):
    from megagrpo.model.gpt import build_model
    from megagrpo.model.optim import build_optimizer, wrap_ddp

    gpt = build_model(mcfg, parallel, seed=21)
    ddp = wrap_ddp(gpt, optim_cfg)
    return gpt, ddp, build_optimizer(ddp, optim_cfg)


def _run(ddp, mcfg, factor: float) -> None:
    from megagrpo.model.optim import forward_backward

    ids, _ = batch = _batch(mcfg.vocab_size)
    forward_backward(ddp, _ce_step(mcfg.vocab_size, factor), [batch], 1,
                     seq_length=ids.shape[1], micro_batch_size=ids.shape[0])


def _reference_grads(gpt16, mcfg, parallel, factor: float) -> dict[str, torch.Tensor]:
    """float64 gradients of the same loss at the fp16 model's weights (upcast exactly)."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from megagrpo.model.gpt import build_model
    from megagrpo.runtime.cpu_compat import megatron_scope

    ref = build_model(dataclass_with(mcfg, dtype="float32"), parallel, seed=21)
    with torch.no_grad():
        for (_, p), (_, q) in zip(ref.named_parameters(), gpt16.named_parameters(), strict=True):
            p.copy_(q.double())
    ref.double()
    ids, labels = _batch(mcfg.vocab_size)
    with megatron_scope():
        out = ref(ids, torch.arange(ids.shape[1]).expand_as(ids), None)
        logits = gather_from_tensor_model_parallel_region(out)[..., :mcfg.vocab_size]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, mcfg.vocab_size),
                                                 labels.reshape(-1)) * factor
        loss.backward()
    return {n: p.grad.detach() for n, p in ref.named_parameters()}


def dataclass_with(cfg, **changes):
    out = copy.deepcopy(cfg)
    for k, v in changes.items():
        setattr(out, k, v)
    return out


def _main_grad_errors(gpt, opt, ref: dict[str, torch.Tensor]) -> dict:
    """Relative L2 error of each parameter's unscaled fp32 main gradient against float64; the
    share of reference entries != 0 whose fp16-path gradient is exactly 0 (flushed)."""
    from megagrpo.runtime.cpu_compat import megatron_scope

    with megatron_scope():
        found_inf = opt.prepare_grads()  # main grads -> main params' .grad, / loss scale
    errs, zeros, nonzero = {}, 0, 0
    for n, p in gpt.named_parameters():
        g, r = p.main_param.grad.double(), ref[n]
        errs[n] = float((g - r).norm() / r.norm().clamp_min(1e-300))
        live = r != 0
        zeros += int((g[live] == 0).sum())
        nonzero += int(live.sum())
    return {"max_rel_err": max(errs.values()), "errs": errs, "flushed": zeros / nonzero,
            "found_inf": bool(found_inf)}


def gradient_checks(mcfg, parallel) -> dict:
    from megagrpo.config.optim import OptimConfig
    from megagrpo.model.optim import loss_scale

    out = {}
    for name, ocfg in (("dynamic", OptimConfig(lr=1e-3)),
                       ("unscaled", OptimConfig(lr=1e-3, loss_scale=1.0))):
        gpt, ddp, opt = _fp16_policy(mcfg, parallel, ocfg)
        scale = loss_scale(opt)
        _run(ddp, mcfg, LOSS_SIZE)
        ref = _reference_grads(gpt, mcfg, parallel, LOSS_SIZE)
        out[name] = {"scale": scale, **_main_grad_errors(gpt, opt, ref)}
        out[name]["dtypes"] = sorted({str(p.dtype) for p in gpt.parameters()})
    return out


def _snapshot(gpt, opt) -> list[torch.Tensor]:
    from megagrpo.model.optim import torch_adams

    state = [t.clone() for o in torch_adams(opt) for s in o.state.values()
             for t in s.values() if torch.is_tensor(t)]
    return ([p.detach().clone() for p in gpt.parameters()]
            + [p.main_param.detach().clone() for p in gpt.parameters()] + state)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def overflow_checks(mcfg, parallel, work: Path) -> dict:
    """Steps from an overflowing scale until one applies; then the scaler's state round trip."""
    from megagrpo.checkpoint import load_optimizer, save_optimizer
    from megagrpo.config.optim import OptimConfig
    from megagrpo.model.optim import (
        loss_scale,
        optimizer_step,
        scaler_can_back_off,
        zero_grad,
    )

    ocfg = OptimConfig(lr=1e-3, initial_loss_scale=OVERFLOW_SCALE, loss_scale_hysteresis=1)
    gpt, ddp, opt = _fp16_policy(mcfg, parallel, ocfg)
    steps, unchanged = [], True
    for _ in range(40):
        before, scale = _snapshot(gpt, opt), loss_scale(opt)
        probe = scaler_can_back_off(opt)
        zero_grad(ddp, opt)
        _run(ddp, mcfg, 1.0)
        applied, _ = optimizer_step(ddp, opt)
        steps.append({"scale": scale, "applied": applied, "probe": probe})
        if applied:
            moved = not _same(before, _snapshot(gpt, opt))
            break
        unchanged = unchanged and _same(before, _snapshot(gpt, opt))
    res = {"steps": steps, "skipped_left_state": unchanged, "applied_moved": moved,
           "scale_after": loss_scale(opt)}
    # a scaler at its floor: an overflow there is a non-finite gradient, not a probe
    floor = OptimConfig(lr=1e-3, initial_loss_scale=OVERFLOW_SCALE,
                        min_loss_scale=OVERFLOW_SCALE)
    res["probe_at_floor"] = scaler_can_back_off(_fp16_policy(mcfg, parallel, floor)[2])
    # resume: the scaler's state round trip through megagrpo's optimizer checkpoint
    scaler = _scaler(opt)
    saved = {"scale": float(scaler.scale.item()), "growth": scaler._growth_tracker,
             "hysteresis": scaler._hysteresis_tracker}
    save_optimizer(gpt, opt, work / "fp16_optimizer")
    gpt2, _, opt2 = _fp16_policy(mcfg, parallel, OptimConfig(lr=1e-3))
    with torch.no_grad():
        for p, q in zip(gpt2.parameters(), gpt.parameters()):
            p.copy_(q)
    fresh = loss_scale(opt2)
    load_optimizer(gpt2, opt2, work / "fp16_optimizer")
    s2 = _scaler(opt2)
    res["resume"] = {"saved": saved, "fresh_scale": fresh,
                     "loaded": {"scale": float(s2.scale.item()), "growth": s2._growth_tracker,
                                "hysteresis": s2._hysteresis_tracker}}
    return res


def _scaler(opt):
    return next(o.grad_scaler for o in getattr(opt, "chained_optimizers", [opt]))


def fp16_checks(cfg, work: Path) -> dict:
    mcfg = dataclass_with(cfg.model, dtype="float16")
    return {"grads": gradient_checks(mcfg, cfg.parallel),
            "overflow": overflow_checks(mcfg, cfg.parallel, work)}
