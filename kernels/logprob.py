"""Vocab-parallel token log-probability (and entropy) from local logits, forward and backward.

Each tensor-parallel rank holds logits ``[T, V_local]`` for its vocab slice (rank r owns global
ids ``[r * V_local, (r + 1) * V_local)``). For every row the forward reads the local logits once
and produces four fp32 statistics of ``z = logits / temperature``:

    m  = max_i z_i                      (local max)
    s  = sum_i exp(z_i - m)             (local sum-exp, relative to m)
    zt = z_target if target is local, else 0
    w  = sum_i exp(z_i - m) * (z_i - m) (only with entropy; relative to m for accuracy)

The ranks then exchange these ``[T, 4]`` stats in ONE all_gather and every rank combines them
(``_vocab_stats.combine``) by rescaling with ``exp(m_r - M)``, ``M = max_r m_r``:

    S = sum_r s_r e^{m_r - M},  lse = M + log S,  logp = sum_r zt_r - lse
    W = sum_r e^{m_r - M} (w_r + s_r (m_r - M)),  H = log S - W / S,  mu = E_p[z] = M + W / S

Backward needs no collective: with ``p = softmax(z)`` over the full vocab (``p_i = e^{z_i-lse}``),

    d logp / d logits_i = (1[i = target] - p_i) / temperature
    d H    / d logits_i = -p_i (z_i - mu) / temperature

so each rank writes ``(g (onehot - p) - h p (z - mu)) / temperature`` for its slice, in one more
pass over its logits. With ``inplace_backward=True`` that gradient overwrites the logits buffer
(the caller promises the logits are not used again); otherwise it goes to a new buffer of the
logits' dtype. No fp32 ``[T, V]`` tensor is ever created: the Triton kernels stream blocks of a
row, and the torch path (CPU fallback and test oracle) works on bounded chunks of rows.

The row passes and the combine live in ``_vocab_stats`` (the fused output layer runs them too);
this module holds the logits op: its chunking of rows, autograd Function and entry point.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import _vocab_stats as vs
from .dispatch import HAS_TRITON, resolve_impl

# The torch path works on chunks of rows; one fp32 chunk buffer holds at most CHUNK_ELEMS
# elements and at most 1/CHUNK_SHARE of the rows (two such buffers are live at a time). On CPU
# 1 MiB chunks stay cache-resident across the several passes over a chunk; on GPU bigger chunks
# amortise kernel launches.
CHUNK_ELEMS = 1 << 18
CHUNK_ELEMS_CUDA = 1 << 24
CHUNK_SHARE = 64
# ... but a chunk may always hold MIN_CHUNK_ELEMS (256 KiB fp32): below that, splitting buys no
# memory worth having and costs a dozen op launches per chunk (a 500 x 32 logits tensor was cut
# into 63 chunks, ~20 ms of launches for microseconds of math).
MIN_CHUNK_ELEMS = 1 << 16

if HAS_TRITON:  # the ahead-of-time compile test (tests/kernels/test_logprob.py) reads them here
    _logprob_fwd_kernel, _logprob_bwd_kernel = vs.logprob_fwd_kernel, vs.logprob_bwd_kernel


def _chunk_rows(n_rows: int, n_cols: int, device: torch.device) -> int:
    """Rows per chunk: at most CHUNK_ELEMS elements and at most 1/64 of the rows (but
    MIN_CHUNK_ELEMS elements in any case), so the two live fp32 chunk buffers stay under ~6% of
    bf16 logits (~3% of fp32) whenever the logits exceed 64 x MIN_CHUNK_ELEMS elements."""
    budget = CHUNK_ELEMS_CUDA if device.type == "cuda" else CHUNK_ELEMS
    by_budget = budget // max(n_cols, 1)
    by_share = max(-(-n_rows // CHUNK_SHARE), MIN_CHUNK_ELEMS // max(n_cols, 1))
    return max(1, min(4096, by_budget, by_share))


class VocabParallelLogProb(torch.autograd.Function):
    """Autograd wrapper; ``path`` is "triton" or "torch" (already resolved)."""

    @staticmethod
    def forward(ctx, logits, target, ignore_mask, temperature, group, with_entropy,
                inplace_backward, path):
        tp, rank = vs.tp_info(group)
        vocab_start = rank * logits.shape[1]
        inv_temp = 1.0 / temperature
        stats_fn = vs.row_fns(path, _chunk_rows(*logits.shape, logits.device))[0]
        stats = stats_fn(logits, target, vocab_start, inv_temp, with_entropy)
        logp, entropy, big_m, log_s, shift = vs.reduce_stats(stats, group, tp, ~ignore_mask,
                                                             with_entropy)
        ctx.save_for_backward(logits, target, ignore_mask, big_m, log_s, shift)
        ctx.args = (vocab_start, inv_temp, with_entropy, inplace_backward, path)
        ctx.backward_done = False
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*(() if with_entropy else (entropy,)))
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        vocab_start, inv_temp, with_entropy, inplace, path = ctx.args
        if inplace and ctx.backward_done:
            raise RuntimeError("inplace_backward=True overwrote the logits: backward runs once")
        ctx.backward_done = True
        logits, target, ignore_mask, big_m, log_s, shift = ctx.saved_tensors
        if g_logp is None and g_ent is None:
            return (None,) * 8
        g_logp, g_ent = vs.masked_grads(~ignore_mask, g_logp, g_ent, with_entropy)
        grad = logits.detach() if inplace else torch.empty_like(logits)
        bwd = vs.row_fns(path, _chunk_rows(*logits.shape, logits.device))[1]
        bwd(logits, grad, target, big_m, log_s, shift, g_logp, g_ent, vocab_start, inv_temp)
        if inplace and path == "triton":
            # The torch path's copy_ bumps the version counter; do the same for the raw kernel
            # write, so any other saved use of these logits (a broken promise) fails loudly.
            torch.autograd.graph.increment_version(grad)
        del logits  # with inplace, `grad` is now the only handle on that buffer
        return grad, None, None, None, None, None, None, None


def vocab_parallel_logprob(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    temperature: float = 1.0,
    group: "dist.ProcessGroup | None" = None,
    ignore_mask: torch.Tensor | None = None,
    with_entropy: bool = False,
    inplace_backward: bool = False,
    impl: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of ``target`` under ``softmax(logits / temperature)``, vocab-parallel.

    Args:
        logits: ``[T, V_local]`` bf16/fp16/fp32, this rank's vocab slice (rank r of ``group``
            owns global ids ``[r * V_local, (r + 1) * V_local)``).
        target: ``[T]`` int64 global token ids (any value where ``ignore_mask`` is True).
        temperature: sampling temperature; logits are divided by it.
        group: tensor-parallel process group, or None for TP=1.
        ignore_mask: ``[T]`` bool, True = ignore (logp 0, entropy 0, gradient 0).
        with_entropy: also return the full-vocab entropy ``[T]`` (differentiable).
        inplace_backward: write the logits gradient into the logits buffer. Only when the caller
            never reads the logits again; backward can then run once (no retain_graph reuse).
        impl: "auto" (see ``dispatch``), "triton" or "torch".

    Returns:
        ``logp`` ``[T]`` fp32, or ``(logp, entropy)`` when ``with_entropy``. One all_gather of a
        ``[tp, T, 4]`` fp32 tensor per call when TP > 1; backward needs no communication.
    """
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(f"want logits [T, V_local] and target [T], got {tuple(logits.shape)} "
                         f"and {tuple(target.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    path = resolve_impl(impl, logits, "vocab_parallel_logprob")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    dev = logits.device
    if ignore_mask is None:
        ignore_mask = torch.zeros(target.shape, dtype=torch.bool, device=dev)
    logp, entropy = VocabParallelLogProb.apply(
        logits, target.to(dev, torch.long).contiguous(), ignore_mask.to(dev, torch.bool),
        float(temperature), group, with_entropy, inplace_backward, path,
    )
    return (logp, entropy) if with_entropy else logp
