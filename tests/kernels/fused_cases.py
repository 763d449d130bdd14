"""Cases, float64 references, runners and the TP worker for the fused output layer's tests.

A case is hidden states ``h [T, H]`` and the WHOLE output weight ``W [V, H]`` (vocab padding
at the end, as megatron pads). The float64 reference forms the logits ``h W^T`` in float64 and
reuses ``kernels_oracle``'s token-by-token oracles (which share no code with megagrpo.kernels);
``dh`` and ``dW`` follow from their logits gradient by the chain rule, in float64. The "logits
path" runner is what megagrpo ran before the fused layer: ``h @ W_local^T`` in the inputs'
dtype, padding columns set to ``PAD_LOGIT``, the fused logits kernel, and (under TP) the input
gradient all-reduced as megatron's ColumnParallelLinear does.
"""
from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import torch
import torch.distributed as dist

from tests.kernels.kernels_oracle import GRPO_OPTIONS, edge_targets, oracle_grpo
from tests.support.launch import count_collectives, gloo_rank, save_rank

PAD_LOGIT = -1e9  # megagrpo.train.losses.PAD_LOGIT (not imported: that module pulls in megatron)


def fused_case(n: int, hdim: int, v: int, tp: int, dtype: torch.dtype, seed: int, *,
               kind: str = "grpo", options: dict | None = None, temperature: float = 0.9,
               pad: int = 0, logit_scale: float = 3.0) -> dict:
    """``v`` padded vocab rows (``pad`` of them padding), ``n`` tokens, every 5th ignored."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hdim, generator=g).to(dtype)
    w = (torch.randn(v, hdim, generator=g) * (logit_scale / math.sqrt(hdim))).to(dtype)
    real = v - pad
    target = edge_targets(n, v, tp, seed).clamp(max=real - 1)
    mask = torch.ones(n, dtype=torch.bool)
    mask[2::5] = False
    case = dict(kind=kind, h=h, w=w, real=real, target=target, mask=mask,
                temperature=temperature, g=torch.randn(n, generator=g),
                e=torch.randn(n, generator=g))
    if kind == "logprob":
        case["target"] = torch.where(mask, target, -100)  # garbage ids where ignored
        return case
    true = reference64(case)[0].float()
    scale = 0.12 if (options or {}).get("ratio_level") == "sequence" else 0.6
    old = true + scale * torch.randn(n, generator=g)
    old[~mask] = float("inf")  # garbage at masked tokens must not leak
    kwargs = dict(options or {})
    if kwargs.get("ratio_level") == "sequence":
        kwargs["seq_ids"] = torch.arange(n) // 6
    if "is_cap" in kwargs:
        kwargs["is_weight"] = torch.rand(n, generator=g) * 2.5
    if kwargs.get("beta", 0.0) != 0.0:
        kwargs["ref_logp"] = true + 0.5 * torch.randn(n, generator=g)
    case.update(old_logp=old, advantages=torch.randn(n, generator=g), kwargs=kwargs)
    return case


def grpo_cases(tp: int, hdim: int = 16, v_local: int = 300) -> dict:
    """Every loss option; every third in bf16; one with a padded last shard."""
    cases = {}
    for i, (name, opt) in enumerate(GRPO_OPTIONS.items()):
        dtype = torch.bfloat16 if i % 3 == 2 else torch.float32
        cases["grpo_" + name] = fused_case(18, hdim, v_local * tp, tp, dtype, 40 + i,
                                           options=opt, pad=37 if i == 1 else 0)
    return cases


# ------------------------------------------------------------------------------ float64 reference
def _logits64(case) -> torch.Tensor:
    """fp32 inputs: the exact float64 product. bf16 inputs: the bf16 logits a matmul of them
    gives (what both paths compute), then float64: the check is then that everything after the
    matmul runs at fp32 accuracy. (Against logits from the exact product, a GRPO token near a
    clip bound flips sides and its gradient jumps by O(1).)"""
    h, w = case["h"], case["w"][:case["real"]]
    if h.dtype in (torch.float32, torch.float64):
        return h.double() @ w.double().T
    return (h @ w.T).double()


def reference64(case) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, entropy) in float64 through the full logits (0 at ignored tokens)."""
    logsm = torch.log_softmax(_logits64(case) / case["temperature"], dim=-1)
    idx = case["target"].clamp(0, case["real"] - 1)
    logp = logsm.gather(1, idx[:, None]).squeeze(1)
    ent = -(logsm.exp() * logsm).sum(dim=-1)
    keep = case["mask"]
    return torch.where(keep, logp, 0.0), torch.where(keep, ent, 0.0)


def reference_grads(case) -> dict:
    """Float64 outputs and (dh, dW) of sum(g*logp + e*entropy) or sum(g*loss)."""
    w_real = case["w"][:case["real"]].double()
    if case["kind"] == "logprob":
        x = _logits64(case).requires_grad_()
        logsm = torch.log_softmax(x / case["temperature"], dim=-1)
        logp = logsm.gather(1, case["target"].clamp(0, case["real"] - 1)[:, None]).squeeze(1)
        ent = -(logsm.exp() * logsm).sum(dim=-1)
        keep = case["mask"]
        logp, ent = torch.where(keep, logp, 0.0), torch.where(keep, ent, 0.0)
        (logp * case["g"].double() + ent * case["e"].double()).sum().backward()
        out, grad = dict(logp=logp.detach(), entropy=ent.detach()), x.grad
    else:
        loss, grad, flags = oracle_grpo(dict(case, logits=_logits64(case)))
        out = dict(loss=loss, **flags)
        out["logp"], out["entropy"] = reference64(case)
    dw = torch.zeros(case["w"].shape, dtype=torch.float64)
    dw[:case["real"]] = grad.T @ case["h"].double()
    return dict(out, dh=grad @ w_real, dw=dw)


# ------------------------------------------------------------------------------ runners
def shard(case, rank: int, tp: int) -> tuple[torch.Tensor, int]:
    """This rank's weight rows and how many of them are real tokens."""
    v_local = case["w"].shape[0] // tp
    valid = max(0, min(v_local, case["real"] - rank * v_local))
    return case["w"][rank * v_local:(rank + 1) * v_local], valid


def _backward_of(case, out) -> torch.Tensor:
    if case["kind"] == "logprob":
        return (out["logp"] * case["g"] + out["entropy"] * case["e"]).sum()
    return (out["loss"] * case["g"]).sum()


def run_fused(case, impl: str, group=None, rank: int = 0, tp: int = 1, chunk=(8, 128)) -> dict:
    """The fused op on this rank's shard; dh is already summed over the group by the op."""
    from megagrpo.kernels import fused_output_grpo_loss, fused_output_logprob

    w_local, valid = shard(case, rank, tp)
    h = case["h"].clone().requires_grad_()
    w = w_local.clone().requires_grad_()
    common = dict(temperature=case["temperature"], group=group, valid_vocab=valid, impl=impl,
                  chunk_tokens=chunk[0], chunk_vocab=chunk[1])
    if case["kind"] == "logprob":
        logp, ent = fused_output_logprob(h, w, case["target"], ignore_mask=~case["mask"],
                                         with_entropy=True, **common)
        out = dict(logp=logp, entropy=ent)
    else:
        loss, metrics = fused_output_grpo_loss(h, w, case["target"], case["old_logp"],
                                               case["advantages"], case["mask"], **common,
                                               **case["kwargs"])
        out = dict(metrics, loss=loss)
    _backward_of(case, out).backward()
    return dict({k: v.detach() for k, v in out.items()}, dh=h.grad, dw=w.grad)


GRAD_OUTPUT = 0.37
"""Gradient reaching the weighted loss (megatron's loss scale / micro-batches): a backward that
ignored it would be off by 1/0.37."""


def run_weighted(case, impl: str, group=None, rank: int = 0, tp: int = 1, chunk_tokens: int = 5,
                 token_weight: torch.Tensor | None = None) -> dict:
    """``fused_output_grpo_weighted_loss`` with ``token_weight`` (default the case's ``g``),
    backward from ``GRAD_OUTPUT``; dh, dW are divided by it again (comparable with
    ``reference_grads``, the gradients of ``sum(g * loss)``)."""
    from megagrpo.kernels import fused_output_grpo_weighted_loss

    w_local, valid = shard(case, rank, tp)
    h = case["h"].clone().requires_grad_()
    w = w_local.clone().requires_grad_()
    weight = case["g"] if token_weight is None else token_weight
    loss, tok, metrics = fused_output_grpo_weighted_loss(
        h, w, case["target"], case["old_logp"], case["advantages"], case["mask"], weight,
        temperature=case["temperature"], group=group, valid_vocab=valid, impl=impl,
        chunk_tokens=chunk_tokens, chunk_vocab=128, grad_in_forward=True, **case["kwargs"])
    (loss * GRAD_OUTPUT).backward()
    return dict(metrics, loss=tok, total=loss.detach(), dh=(h.grad.double() / GRAD_OUTPUT),
                dw=(w.grad.double() / GRAD_OUTPUT), dh_dtype=h.grad.dtype,
                dw_dtype=w.grad.dtype)


def run_logits(case, impl: str, group=None, rank: int = 0, tp: int = 1) -> dict:
    """The logits path: output-layer matmul, padding masked, the logits kernel."""
    from megagrpo.kernels import grpo_token_loss, vocab_parallel_logprob

    w_local, valid = shard(case, rank, tp)
    h = case["h"].clone().requires_grad_()
    w = w_local.clone().requires_grad_()
    logits = h @ w.T
    logits[:, valid:] = PAD_LOGIT
    if case["kind"] == "logprob":
        logp, ent = vocab_parallel_logprob(logits, case["target"], temperature=case["temperature"],
                                           group=group, ignore_mask=~case["mask"],
                                           with_entropy=True, impl=impl)
        out = dict(logp=logp, entropy=ent)
    else:
        loss, metrics = grpo_token_loss(logits, case["target"], case["old_logp"],
                                        case["advantages"], case["mask"], group=group,
                                        temperature=case["temperature"], impl=impl,
                                        **case["kwargs"])
        out = dict(metrics, loss=loss)
    _backward_of(case, out).backward()
    dh = h.grad
    if tp > 1:  # megatron's ColumnParallelLinear all-reduces its input gradient
        dh32 = dh.float()
        dist.all_reduce(dh32, group=group)
        dh = dh32.to(dh.dtype)
    return dict({k: v.detach() for k, v in out.items()}, dh=dh, dw=w.grad)


# ------------------------------------------------------------------------------ comparisons
def max_err(actual: torch.Tensor, ref: torch.Tensor) -> float:
    return float((actual.double() - ref.double()).abs().max()) if ref.numel() else 0.0


def assert_near(actual, ref, tol: float, what: str) -> None:
    """max |actual - ref| <= tol * max(1, max |ref|): errors of a sum scale with its terms."""
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    scale = max(1.0, float(ref.double().abs().max())) if ref.numel() else 1.0
    err = max_err(actual, ref)
    assert err <= tol * scale, f"{what}: max err {err:.3g} > {tol:.3g} x {scale:.3g}"


class GradTol(NamedTuple):
    """A gradient entry passes at |actual - ref| <= rtol |ref| + atol max(1, max |ref|)."""

    rtol: float
    atol: float


def assert_grad_near(actual, ref, tol: GradTol, what: str) -> None:
    """Per element: a relative part (bf16 rounds each entry by its own size) and a small
    absolute floor against the largest entry (sums of terms of mixed signs cancel)."""
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    if not ref.numel():
        return
    ref64 = ref.double()
    scale = max(1.0, float(ref64.abs().max()))
    err = (actual.double() - ref64).abs()
    excess = err - (tol.rtol * ref64.abs() + tol.atol * scale)
    worst = int(excess.argmax())
    assert float(excess.flatten()[worst]) <= 0, (
        f"{what}: entry {worst}: err {float(err.flatten()[worst]):.3g} > {tol.rtol:.3g} x "
        f"|{float(ref64.flatten()[worst]):.3g}| + {tol.atol:.3g} x {scale:.3g}")


BF16_GRAD = GradTol(rtol=1.6e-2, atol=4e-3)
"""bf16 gradients: two bf16 ulps (2^-6) of each entry, plus 4e-3 of the largest one (measured
on these cases: <= 2e-3 beyond the relative part, the 256-token, H=96 case the largest)."""
TOL64 = {torch.float32: (2e-5, GradTol(0.0, 2e-5)), torch.bfloat16: (2e-5, BF16_GRAD)}
"""(outputs, gradients) against float64 (on the bf16 logits for bf16, see `_logits64`): fp32
rounding; bf16 gradients are rounded to bf16 once per chunk GEMM (a bf16 ulp or two)."""
TOL_LOGITS = {torch.float32: (2e-5, GradTol(0.0, 2e-5)), torch.bfloat16: (2e-5, BF16_GRAD)}
"""Against the logits path: the same bf16 logits (outputs agree to ~1e-8), but the bf16
gradient GEMMs are rounded per chunk (fused, summed in fp32) vs once over the whole vocab
(megatron): a bf16 ulp or two."""


def check(case, out, ref, tol: tuple[float, GradTol], what: str, grads: bool = True) -> None:
    keys = ["logp", "entropy"] + (["loss"] if case["kind"] == "grpo" else [])
    for k in keys:
        assert_near(out[k], ref[k], tol[0], f"{what} {k}")
    if case["kind"] == "grpo":
        assert (out["loss"][~case["mask"]] == 0).all(), f"{what}: masked tokens have a loss"
    if grads:
        dtypes = out.get("dh_dtype", out["dh"].dtype), out.get("dw_dtype", out["dw"].dtype)
        assert dtypes == (case["h"].dtype, case["w"].dtype), f"{what}: {dtypes}"
        assert_grad_near(out["dh"], ref["dh"], tol[1], f"{what} dh")
        assert_grad_near(out["dw"], ref["dw"], tol[1], f"{what} dW")


def _counted(*args, _fn, _counts: dict[str, int], _key: str, **kwargs):
    _counts[_key] += 1
    return _fn(*args, **kwargs)


def count_fused_paths(set_attr=setattr) -> dict[str, int]:
    """Counts the fused op's two training paths: "forward_grads" (the gradient computed in the
    forward, token-separable losses) and "recompute" (the recomputing backward: GSPO).
    `set_attr` puts the counting wrappers in place (pytest's monkeypatch.setattr in a test)."""
    from megagrpo.kernels import fused_output as fo

    counts = {"forward_grads": 0, "recompute": 0}
    for key, name in (("forward_grads", "_loss_and_grads"), ("recompute", "_backward")):
        set_attr(fo, name, partial(_counted, _fn=getattr(fo, name), _counts=counts, _key=key))
    return counts


# ------------------------------------------------------------------------------ TP worker
def tp_worker(rank: int, world: int, rdzv: str, cases_path: str, out_dir: str) -> None:
    """Spawned gloo rank: every case on the fused op (both paths where asked) and the logits
    path; counts the collectives of each fused call (forward, backward) and of scoring."""
    from megagrpo.kernels import fused_output_logprob

    with gloo_rank(rank, world, rdzv) as group:
        calls = count_collectives()
        spec = torch.load(cases_path, weights_only=False)
        results = {}
        for name, case in spec["cases"].items():
            impls = spec["impls"].get(name, ("torch",))
            for impl in impls:
                before = calls[0]
                out = run_fused(case, impl, group, rank, world)
                out["collectives"] = calls[0] - before
                results[(name, impl)] = out
            results[(name, "logits")] = run_logits(case, "torch", group, rank, world)
            if case["kind"] == "grpo":  # the gradient-in-forward path (GSPO: its fallback)
                for impl in impls:
                    before = calls[0]
                    out = run_weighted(case, impl, group, rank, world)
                    out["collectives"] = calls[0] - before
                    results[(name, "weighted", impl)] = out
        case = next(iter(spec["cases"].values()))
        w_local, valid = shard(case, rank, world)
        before = calls[0]
        with torch.no_grad():  # scoring: forward only
            fused_output_logprob(case["h"], w_local, case["target"], group=group,
                                 valid_vocab=valid, impl="torch")
        results["scoring_collectives"] = calls[0] - before
        save_rank(results, out_dir, rank)
