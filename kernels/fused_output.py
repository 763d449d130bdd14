"""Fused output layer: per-token log-prob, entropy and the GRPO loss straight from hidden states.

The logits path (megatron's output layer, then ``logprob.vocab_parallel_logprob``) holds the
logits ``[T, V_local]`` of a micro-batch - for a 152k vocabulary the biggest activation of the
step. This op takes the final hidden states ``h [T, H]`` and this rank's output weight
``W [V_local, H]`` instead and never holds more than one chunk ``[Tc, Vc]`` of logits:

Forward, for each vocab chunk ``c`` (outer) and token chunk ``t`` (inner)::

    z = (h_t @ W_c^T) / temperature               one [Tc, Vc] chunk, in h's dtype
    stats_t <- merge(stats_t, local_stats(z))     online (m, s, zt, w) per token, fp32

``local_stats`` is the per-row statistic of ``logprob`` (max m, sum-exp s relative to m, target
logit zt, sum p*(z - m) as w) and ``merge`` rescales two such rows by ``exp(m_i - max)`` - the
same combine ``logprob._combine`` applies across tensor-parallel ranks. After the loop the
``[T, 4]`` stats go through exactly the logits path's TP combine (``_gather_stats`` and
``_combine``): log-prob, entropy and the normalisers ``M``, ``log S``, ``E_p[z] - M``.

Backward recomputes every chunk's logits, turns them in place into their gradient with the
logits path's backward (``d logp / dz = onehot - p``, ``d H / dz = -p (z - mu)``, over
``temperature``) and accumulates ``dh_t += dz @ W_c`` and ``dW_c += dz^T @ h_t`` in fp32. The
vocab-outer order finishes each ``dW_c`` before the next chunk starts, so the fp32 accumulators
are ``[T, H]`` (dh) and ``[Vc, H]``: for bf16 inputs, extra memory ~``(T + Vc) H`` fp32 besides
two chunks; for fp32 they are the outputs themselves. Vocab padding rows of ``W`` (beyond
``valid_vocab``) take no part and get a zero gradient, as the logits path's ``PAD_LOGIT`` does.

Precision: each chunk's matmul runs in the inputs' dtype (for bf16 exactly the logits megatron
would have produced, up to GEMM summation order), everything after it in fp32; the per-chunk
products of the gradient GEMMs are accumulated in fp32.

Collectives per call under TP, the same count as the logits path: forward, ONE all_gather of
the ``[T, 4]`` fp32 stats (the logits path's kernel does the same); backward, ONE all_reduce (sum)
of ``dh`` ``[T, H]`` over the group (the logits path: megatron's ColumnParallelLinear all-reduces
its input gradient). That all_reduce is in fp32 (the accumulator), twice the bytes of megatron's
bf16 one in a bf16 model. Nothing else communicates; ``dW`` is local to the shard.

Paths (``dispatch.resolve_impl``, logged once): "torch" runs the per-chunk statistics and
gradient with the chunked torch code of ``logprob``; "triton" with its Triton kernels, each
chunk's matmuls being cuBLAS (``torch.mm``) on GPU. ``reference_output_logprob`` is the
float64 full-logits reference (tests, benchmark baseline).
"""
from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from .dispatch import resolve_impl
from .grpo_loss import _check_options, grpo_loss_from_logp
from .logprob import (
    CHUNK_ELEMS as ROW_CHUNK_ELEMS,
)
from .logprob import (
    NUM_STATS,
    _combine,
    _gather_stats,
    _torch_backward,
    _torch_stats,
    _tp_info,
    _triton_backward,
    _triton_stats,
)

CHUNK_TOKENS = 1024
"""Tokens per chunk (CPU): big enough for an efficient matmul."""
CHUNK_ELEMS = 1 << 22
"""Logits per chunk (CPU): 16 MiB fp32, Vc = CHUNK_ELEMS // Tc. At T=1024, H=1024, V=16384
(interleaved runs on a loaded 2-core AVX-512 machine, not a benchmark figure) 1M-value chunks
took 1.8x the logits path's time and 4M 1.2x: bigger matmuls, fewer launches."""
CHUNK_TOKENS_CUDA = 4096
CHUNK_ELEMS_CUDA = 1 << 25
"""Logits per chunk on GPU (128 MiB fp32): amortises launches; ~1% of a 16k x 152k logits."""
CHUNK_SHARE = 32
"""... but a chunk holds at most 1/CHUNK_SHARE of the logits it replaces, once those exceed
CHUNK_SHARE x MIN_CHUNK_ELEMS values (small calls keep one chunk of MIN_CHUNK_ELEMS)."""
MIN_CHUNK_ELEMS = 1 << 20
MIN_CHUNK_VOCAB = 256


def chunk_shape(n_rows: int, n_cols: int, cuda: bool, chunk_tokens: int | None = None,
                chunk_vocab: int | None = None) -> tuple[int, int]:
    """(Tc, Vc) of the logits chunks for ``n_rows`` tokens and ``n_cols`` vocab columns, on a
    GPU (``cuda``) or the CPU (the planner reads it too)."""
    tc = chunk_tokens or min(max(n_rows, 1), CHUNK_TOKENS_CUDA if cuda else CHUNK_TOKENS)
    budget = min(CHUNK_ELEMS_CUDA if cuda else CHUNK_ELEMS,
                 max(MIN_CHUNK_ELEMS, n_rows * n_cols // CHUNK_SHARE))
    vc = chunk_vocab or max(MIN_CHUNK_VOCAB, budget // tc)
    return max(1, tc), max(1, min(vc, max(n_cols, 1)))


def _merge_stats(acc: torch.Tensor, new: torch.Tensor) -> None:
    """``acc <- merge(acc, new)`` for ``[n, 4]`` (m, s, zt, w) rows of two disjoint vocab
    ranges: the chunk-to-chunk twin of ``logprob._combine``'s rank-to-rank rescaling."""
    m_a, s_a, zt_a, w_a = acc.unbind(dim=1)
    m_b, s_b, zt_b, w_b = new.unbind(dim=1)
    big_m = torch.maximum(m_a, m_b)
    e_a, e_b = torch.exp(m_a - big_m), torch.exp(m_b - big_m)
    w = e_a * (w_a + s_a * (m_a - big_m)) + e_b * (w_b + s_b * (m_b - big_m))
    s = s_a * e_a + s_b * e_b
    acc[:, 3] = w
    acc[:, 2] = zt_a + zt_b
    acc[:, 1] = s
    acc[:, 0] = big_m


def _row_fns(path: str, vc: int):
    """(stats, backward) of one logits chunk: the Triton kernels, or logprob's torch path on
    cache-sized slices of the chunk's rows (ROW_CHUNK_ELEMS fp32 values each)."""
    if path == "triton":
        return _triton_stats, _triton_backward
    rows = max(1, ROW_CHUNK_ELEMS // max(vc, 1))
    return partial(_torch_stats, chunk_rows=rows), partial(_torch_backward, chunk_rows=rows)


def _accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b``; ``acc`` fp32, ``a``/``b`` in the inputs' dtype (product in it too)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    else:
        acc.add_(a @ b)


def _forward_stats(hidden, weight, target, vocab_start, valid, inv_temp, with_entropy, shape,
                   path) -> torch.Tensor:
    """This rank's ``[T, 4]`` stats over its ``valid`` vocab columns, chunk by chunk."""
    n = hidden.shape[0]
    tc, vc = shape
    stats = torch.zeros((n, NUM_STATS), dtype=torch.float32, device=hidden.device)
    stats[:, 0] = -3.0e38  # finite "minus infinity": the first merge scales it by exactly 0
    stats_fn = _row_fns(path, vc)[0]
    for c0 in range(0, valid, vc):
        w_c = weight[c0:min(c0 + vc, valid)]
        for t0 in range(0, n, tc):
            logits = hidden[t0:t0 + tc] @ w_c.T
            local = stats_fn(logits, target[t0:t0 + tc], vocab_start + c0, inv_temp,
                             with_entropy)
            _merge_stats(stats[t0:t0 + tc], local)
            del logits
    return stats


def _backward(hidden, weight, target, vocab_start, valid, inv_temp, big_m, log_s, shift, g_logp,
              g_ent, shape, path, need_dh, need_dw):
    """(dh fp32 [T, H] or None, dW [V_local, H] in weight's dtype or None), recomputing chunks."""
    n = hidden.shape[0]
    tc, vc = shape
    dh = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_dh else None
    dw = torch.zeros_like(weight) if need_dw else None
    fp32_w = weight.dtype == torch.float32
    bwd_fn = _row_fns(path, vc)[1]
    for c0 in range(0, valid, vc):
        c1 = min(c0 + vc, valid)
        w_c = weight[c0:c1]
        dw_c = None
        if need_dw:
            dw_c = dw[c0:c1] if fp32_w else torch.zeros(w_c.shape, dtype=torch.float32,
                                                        device=w_c.device)
        for t0 in range(0, n, tc):
            t1 = min(t0 + tc, n)
            h_t = hidden[t0:t1]
            grad = h_t @ w_c.T  # the chunk's logits, overwritten with their gradient below
            bwd_fn(grad, grad, target[t0:t1], big_m[t0:t1], log_s[t0:t1], shift[t0:t1],
                   g_logp[t0:t1], None if g_ent is None else g_ent[t0:t1], vocab_start + c0,
                   inv_temp)
            if need_dh:
                _accumulate_mm(dh[t0:t1], grad, w_c)
            if need_dw:
                _accumulate_mm(dw_c, grad.T, h_t)
            del grad
        if need_dw and not fp32_w:
            dw[c0:c1] = dw_c
    return dh, dw


class FusedOutputLogProb(torch.autograd.Function):
    """Autograd wrapper; ``path`` is "triton" or "torch" (already resolved)."""

    @staticmethod
    def forward(ctx, hidden, weight, target, ignore_mask, temperature, group, with_entropy,
                valid, shape, path):
        tp, rank = _tp_info(group)
        vocab_start = rank * weight.shape[0]  # the padded shard width sets the global ids
        inv_temp = 1.0 / temperature
        with torch.no_grad():
            stats = _forward_stats(hidden, weight, target, vocab_start, valid, inv_temp,
                                   with_entropy, shape, path)
        logp, entropy, big_m, log_s, shift = _combine(_gather_stats(stats, group, tp))
        keep = ~ignore_mask
        logp = torch.where(keep, logp, 0.0)
        entropy = torch.where(keep, entropy, 0.0) if with_entropy else torch.zeros_like(logp)
        ctx.save_for_backward(hidden, weight, target, ignore_mask, big_m, log_s, shift)
        ctx.args = (group, tp, vocab_start, valid, inv_temp, with_entropy, shape, path)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*(() if with_entropy else (entropy,)))
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        group, tp, vocab_start, valid, inv_temp, with_entropy, shape, path = ctx.args
        hidden, weight, target, ignore_mask, big_m, log_s, shift = ctx.saved_tensors
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        nones = (None,) * 8
        if (g_logp is None and g_ent is None) or not (need_dh or need_dw):
            return None, None, *nones
        keep = ~ignore_mask
        g_logp = torch.where(keep, g_logp, 0.0) if g_logp is not None else torch.zeros_like(log_s)
        g_ent = torch.where(keep, g_ent, 0.0) if (g_ent is not None and with_entropy) else None
        with torch.no_grad():
            dh, dw = _backward(hidden, weight, target, vocab_start, valid, inv_temp, big_m, log_s,
                               shift, g_logp.float().contiguous(),
                               None if g_ent is None else g_ent.float().contiguous(), shape,
                               path, need_dh, need_dw)
            if dh is not None and tp > 1:
                dist.all_reduce(dh, group=group)  # the call's only backward collective
        return None if dh is None else dh.to(hidden.dtype), dw, *nones


def _prepare(hidden, weight, target, temperature, valid_vocab, impl, op):
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"{op}: want hidden [T, H] and weight [V_local, H], got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    if target.shape != hidden.shape[:1]:
        raise ValueError(f"{op}: target {tuple(target.shape)} must be [T] = "
                         f"[{hidden.shape[0]}]")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"{op}: hidden ({hidden.dtype}) and weight ({weight.dtype}) must share "
                         "a dtype")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    valid = weight.shape[0] if valid_vocab is None else int(valid_vocab)
    if not 0 <= valid <= weight.shape[0]:  # 0: a shard of padding only (other ranks hold all)
        raise ValueError(f"{op}: valid_vocab={valid_vocab} must be in [0, {weight.shape[0]}]")
    path = resolve_impl(impl, hidden, op)
    return hidden.contiguous(), weight.contiguous(), valid, path


def fused_output_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    temperature: float = 1.0,
    group: "dist.ProcessGroup | None" = None,
    ignore_mask: torch.Tensor | None = None,
    with_entropy: bool = False,
    valid_vocab: int | None = None,
    impl: str = "auto",
    chunk_tokens: int | None = None,
    chunk_vocab: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of ``target`` under ``softmax(h W^T / temperature)``, vocab-parallel, fused.

    Args:
        hidden: ``[T, H]`` final hidden states (after the final norm), bf16/fp16/fp32.
        weight: ``[V_local, H]`` this rank's output-layer (or tied embedding) weight, same
            dtype; rank r of ``group`` owns global ids ``[r * V_local, (r + 1) * V_local)``.
        target: ``[T]`` int64 global token ids (any value where ``ignore_mask`` is True).
        temperature, group, ignore_mask, with_entropy, impl: as ``vocab_parallel_logprob``.
        valid_vocab: rows of ``weight`` that are real tokens (the rest is vocab padding, with
            probability 0 and zero gradient); None = all.
        chunk_tokens, chunk_vocab: chunk shape ``[Tc, Vc]`` (None = ``chunk_shape``).

    Returns:
        ``logp`` ``[T]`` fp32, or ``(logp, entropy)``; differentiable w.r.t. ``hidden`` and
        ``weight`` (gradients in their dtypes). Collectives: see the module docstring.
    """
    op = "fused_output_logprob"
    hidden, weight, valid, path = _prepare(hidden, weight, target, temperature, valid_vocab,
                                           impl, op)
    dev = hidden.device
    if ignore_mask is None:
        ignore_mask = torch.zeros(target.shape, dtype=torch.bool, device=dev)
    shape = chunk_shape(hidden.shape[0], valid, dev.type == "cuda", chunk_tokens, chunk_vocab)
    logp, entropy = FusedOutputLogProb.apply(
        hidden, weight, target.to(dev, torch.long).contiguous(), ignore_mask.to(dev, torch.bool),
        float(temperature), group, with_entropy, valid, shape, path,
    )
    return (logp, entropy) if with_entropy else logp


def fused_output_grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ref_logp: torch.Tensor | None = None,
    group=None,
    temperature: float = 1.0,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip_c: float | None = None,
    beta: float = 0.0,
    kl_estimator: str = "k3",
    kl_clamp: tuple[float, float] | None = None,
    ratio_level: str = "token",
    seq_ids: torch.Tensor | None = None,
    is_weight: torch.Tensor | None = None,
    is_cap: float | None = None,
    policy_loss: str = "ppo",
    valid_vocab: int | None = None,
    impl: str = "auto",
    chunk_tokens: int | None = None,
    chunk_vocab: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``grpo_token_loss`` from hidden states: per-token GRPO loss ``[T]`` fp32 and metrics.

    ``hidden`` / ``weight`` / ``valid_vocab`` / ``chunk_*`` as in ``fused_output_logprob``;
    every other argument and the return value exactly as ``grpo_loss.grpo_token_loss`` (the
    same ``grpo_loss_from_logp`` algebra runs on the fused log-probs, so the two agree to the
    log-probs' rounding).
    """
    _check_options(policy_loss, beta, ref_logp, dual_clip_c, ratio_level, seq_ids, kl_estimator)
    logp, entropy = fused_output_logprob(
        hidden, weight, target, temperature=temperature, group=group, ignore_mask=~mask.bool(),
        with_entropy=True, valid_vocab=valid_vocab, impl=impl, chunk_tokens=chunk_tokens,
        chunk_vocab=chunk_vocab,
    )
    return grpo_loss_from_logp(
        logp, old_logp, advantages, mask, entropy=entropy, ref_logp=ref_logp, eps_low=eps_low,
        eps_high=eps_high, dual_clip_c=dual_clip_c, beta=beta, kl_estimator=kl_estimator,
        kl_clamp=kl_clamp, ratio_level=ratio_level, seq_ids=seq_ids, is_weight=is_weight,
        is_cap=is_cap, policy_loss=policy_loss,
    )


def reference_output_logprob(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
    temperature: float = 1.0, ignore_mask: torch.Tensor | None = None,
    valid_vocab: int | None = None, dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, entropy) ``[T]`` through the full logits ``[T, V]`` in ``dtype`` (float64: the
    reference; the inputs' dtype: the naive baseline). ``weight`` is the WHOLE ``[V, H]``
    (one process); differentiable through ``hidden`` and ``weight``."""
    valid = weight.shape[0] if valid_vocab is None else valid_vocab
    logits = hidden.to(dtype) @ weight[:valid].to(dtype).T
    # the naive baseline's matmul runs in the inputs' dtype; its softmax at least in fp32
    z = logits.to(torch.promote_types(dtype, torch.float32)) / temperature
    logsm = torch.log_softmax(z, dim=-1)
    logp = logsm.gather(1, target.clamp(0, valid - 1)[:, None]).squeeze(1)
    entropy = -(logsm.exp() * logsm).sum(dim=-1)
    if ignore_mask is not None:
        logp = torch.where(ignore_mask, 0.0, logp)
        entropy = torch.where(ignore_mask, 0.0, entropy)
    return logp, entropy
