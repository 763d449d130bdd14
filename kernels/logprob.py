"""Vocab-parallel token log-probability (and entropy) from local logits, forward and backward.

Each tensor-parallel rank holds logits ``[T, V_local]`` for its vocab slice (rank r owns global
ids ``[r * V_local, (r + 1) * V_local)``). For every row the forward reads the local logits once
and produces four fp32 statistics of ``z = logits / temperature``:

    m  = max_i z_i                      (local max)
    s  = sum_i exp(z_i - m)             (local sum-exp, relative to m)
    zt = z_target if target is local, else 0
    w  = sum_i exp(z_i - m) * (z_i - m) (only with entropy; relative to m for accuracy)

The ranks then exchange these ``[T, 4]`` stats in ONE all_gather and every rank combines them
(``_combine``) by rescaling with ``exp(m_r - M)``, ``M = max_r m_r``:

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
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .dispatch import HAS_TRITON, resolve_impl

if HAS_TRITON:
    import triton
    import triton.language as tl

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
MAX_BLOCK_V = 4096
NUM_STATS = 4  # m, s, zt, w

# --------------------------------------------------------------------------------------------
# Triton kernels (one program per row; the row is streamed in BLOCK_V-wide blocks)
# --------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _logprob_fwd_kernel(
        logits_ptr, stride_row, target_ptr, stats_ptr, n_cols, vocab_start, inv_temp,
        WITH_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        row_ptr = logits_ptr + row * stride_row
        # A finite "minus infinity" keeps the first rescale exp(m - m_new) * 0 free of NaNs.
        m = -3.0e38
        s = 0.0
        w = 0.0
        for start in range(0, n_cols, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            valid = cols < n_cols
            # Upcast every load: the interpreter computes bf16 on raw bits otherwise.
            z = tl.load(row_ptr + cols, mask=valid, other=-float("inf")).to(tl.float32) * inv_temp
            m_new = tl.maximum(m, tl.max(z, axis=0))
            scale = tl.exp(m - m_new)
            e = tl.exp(z - m_new)
            if WITH_ENTROPY:
                # Move the running sum from base m to base m_new, then add this block.
                d = tl.where(e > 0, z - m_new, 0.0)  # no 0 * inf for padding / -inf logits
                w = scale * (w + s * (m - m_new)) + tl.sum(e * d, axis=0)
            s = s * scale + tl.sum(e, axis=0)
            m = m_new
        local = tl.load(target_ptr + row) - vocab_start
        is_local = (local >= 0) & (local < n_cols)
        zt = tl.load(row_ptr + local, mask=is_local, other=0.0).to(tl.float32) * inv_temp
        zt = tl.where(is_local, zt, 0.0)
        out = stats_ptr + row * 4
        tl.store(out, m)
        tl.store(out + 1, s)
        tl.store(out + 2, zt)
        tl.store(out + 3, w)

    @triton.jit
    def _logprob_bwd_kernel(
        logits_ptr, stride_row, grad_ptr, grad_stride_row, target_ptr, max_ptr, log_s_ptr,
        shift_ptr, g_logp_ptr, g_ent_ptr, n_cols, vocab_start, inv_temp,
        WITH_ENTROPY_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        row_ptr = logits_ptr + row * stride_row
        grad_row_ptr = grad_ptr + row * grad_stride_row
        g = tl.load(g_logp_ptr + row)
        big_m = tl.load(max_ptr + row)
        log_s = tl.load(log_s_ptr + row)
        h = 0.0
        shift = 0.0
        if WITH_ENTROPY_GRAD:
            h = tl.load(g_ent_ptr + row)
            shift = tl.load(shift_ptr + row)
        # Rows without incoming gradient (ignored tokens) get exact zeros, even when their
        # logits are garbage (NaN padding would otherwise give 0 * NaN).
        live = g != 0.0
        if WITH_ENTROPY_GRAD:
            live = live | (h != 0.0)
        local = tl.load(target_ptr + row) - vocab_start
        for start in range(0, n_cols, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            valid = cols < n_cols
            z = tl.load(row_ptr + cols, mask=valid, other=-float("inf")).to(tl.float32) * inv_temp
            # (z - M) first: exact-ish for large logits, unlike z - lse with lse = M + log S.
            zm = z - big_m
            p = tl.exp(zm - log_s)
            grad = tl.where(cols == local, g, 0.0) - g * p
            if WITH_ENTROPY_GRAD:
                grad -= h * p * tl.where(p > 0, zm - shift, 0.0)
            grad = tl.where(live, grad * inv_temp, 0.0)
            # Every element of this block was read above: overwriting in place is safe.
            tl.store(grad_row_ptr + cols, grad.to(grad_ptr.dtype.element_ty), mask=valid)


def _block_v(n_cols: int) -> int:
    return min(triton.next_power_of_2(n_cols), MAX_BLOCK_V)


def _num_warps(block_v: int) -> int:
    return 8 if block_v >= 2048 else 4


def _triton_stats(
    logits: torch.Tensor, target: torch.Tensor, vocab_start: int, inv_temp: float,
    with_entropy: bool,
) -> torch.Tensor:
    """Per-row local stats ``[T, 4]`` fp32 (m, s, zt, w) via the Triton forward kernel."""
    n_rows, n_cols = logits.shape
    stats = torch.empty((n_rows, NUM_STATS), dtype=torch.float32, device=logits.device)
    if n_rows == 0:
        return stats
    block_v = _block_v(n_cols)
    _logprob_fwd_kernel[(n_rows,)](
        logits, logits.stride(0), target, stats, n_cols, vocab_start, inv_temp,
        WITH_ENTROPY=with_entropy, BLOCK_V=block_v, num_warps=_num_warps(block_v),
    )
    return stats


def _triton_backward(
    logits: torch.Tensor, grad: torch.Tensor, target: torch.Tensor, big_m: torch.Tensor,
    log_s: torch.Tensor, shift: torch.Tensor, g_logp: torch.Tensor, g_ent: torch.Tensor | None,
    vocab_start: int, inv_temp: float,
) -> None:
    """Write the gradient w.r.t. the local logits into ``grad`` (may be ``logits`` itself)."""
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    block_v = _block_v(n_cols)
    _logprob_bwd_kernel[(n_rows,)](
        logits, logits.stride(0), grad, grad.stride(0), target, big_m, log_s, shift, g_logp,
        g_logp if g_ent is None else g_ent, n_cols, vocab_start, inv_temp,
        WITH_ENTROPY_GRAD=g_ent is not None, BLOCK_V=block_v, num_warps=_num_warps(block_v),
    )


# --------------------------------------------------------------------------------------------
# Pure-torch path: the same math on chunks of rows (CPU fallback and test oracle)
# --------------------------------------------------------------------------------------------
def _chunk_rows(n_rows: int, n_cols: int, device: torch.device) -> int:
    """Rows per chunk: at most CHUNK_ELEMS elements and at most 1/64 of the rows (but
    MIN_CHUNK_ELEMS elements in any case), so the two live fp32 chunk buffers stay under ~6% of
    bf16 logits (~3% of fp32) whenever the logits exceed 64 x MIN_CHUNK_ELEMS elements."""
    budget = CHUNK_ELEMS_CUDA if device.type == "cuda" else CHUNK_ELEMS
    by_budget = budget // max(n_cols, 1)
    by_share = max(-(-n_rows // CHUNK_SHARE), MIN_CHUNK_ELEMS // max(n_cols, 1))
    return max(1, min(4096, by_budget, by_share))


def _scaled_fp32(x: torch.Tensor, inv_temp: float) -> torch.Tensor:
    """``x / temperature`` as a fresh fp32 buffer (never an alias of the caller's logits)."""
    z = torch.empty(x.shape, dtype=torch.float32, device=x.device).copy_(x)
    return z if inv_temp == 1.0 else z.mul_(inv_temp)


def _local_target(target: torch.Tensor, vocab_start: int, n_cols: int):
    local = target - vocab_start
    is_local = (local >= 0) & (local < n_cols)
    return local.clamp(0, max(n_cols - 1, 0)), is_local


def _torch_stats(
    logits: torch.Tensor, target: torch.Tensor, vocab_start: int, inv_temp: float,
    with_entropy: bool, chunk_rows: int | None = None,
) -> torch.Tensor:
    """Per-row local stats ``[T, 4]`` fp32 (m, s, zt, w), computed chunk by chunk."""
    n_rows, n_cols = logits.shape
    stats = torch.zeros((n_rows, NUM_STATS), dtype=torch.float32, device=logits.device)
    step = chunk_rows or _chunk_rows(n_rows, n_cols, logits.device)
    for r0 in range(0, n_rows, step):
        x = logits[r0:r0 + step]
        z = _scaled_fp32(x, inv_temp)
        m = z.amax(dim=1)
        z.sub_(m[:, None]).clamp_(min=torch.finfo(torch.float32).min)  # -inf logits stay finite
        e = z.exp()
        stats[r0:r0 + step, 0] = m
        stats[r0:r0 + step, 1] = e.sum(dim=1)
        if with_entropy:
            stats[r0:r0 + step, 3] = torch.bmm(e.unsqueeze(1), z.unsqueeze(2)).view(-1)
        del z, e
        idx, is_local = _local_target(target[r0:r0 + step], vocab_start, n_cols)
        zt = x.gather(1, idx[:, None]).view(-1).float() * inv_temp
        stats[r0:r0 + step, 2] = torch.where(is_local, zt, 0.0)
    return stats


def _torch_backward(
    logits: torch.Tensor, grad: torch.Tensor, target: torch.Tensor, big_m: torch.Tensor,
    log_s: torch.Tensor, shift: torch.Tensor, g_logp: torch.Tensor, g_ent: torch.Tensor | None,
    vocab_start: int, inv_temp: float, chunk_rows: int | None = None,
) -> None:
    """Chunked twin of ``_triton_backward``: at most two fp32 chunk buffers are live."""
    n_rows, n_cols = logits.shape
    step = chunk_rows or _chunk_rows(n_rows, n_cols, logits.device)
    for r0 in range(0, n_rows, step):
        r1 = min(r0 + step, n_rows)
        z = _scaled_fp32(logits[r0:r1], inv_temp).sub_(big_m[r0:r1, None])  # z - M
        p = torch.sub(z, log_s[r0:r1, None]).exp_()
        g = g_logp[r0:r1, None] * inv_temp
        if g_ent is not None:
            # z <- (h / temperature) * p * (z - mu); the p > 0 guard keeps -inf logits from
            # giving 0 * inf.
            z.sub_(shift[r0:r1, None]).mul_(p).mul_(g_ent[r0:r1, None] * inv_temp)
            z.masked_fill_(p == 0, 0.0)
            p.mul_(-g).sub_(z)
        else:
            p.mul_(-g)
        idx, is_local = _local_target(target[r0:r1], vocab_start, n_cols)
        p.scatter_add_(1, idx[:, None], torch.where(is_local[:, None], g, 0.0))
        dead = g_logp[r0:r1] == 0
        if g_ent is not None:
            dead &= g_ent[r0:r1] == 0
        p.masked_fill_(dead[:, None], 0.0)  # exact zeros for ignored rows, even with NaN logits
        grad[r0:r1].copy_(p)
        del z, p


# --------------------------------------------------------------------------------------------
# Cross-rank combine and the autograd Function
# --------------------------------------------------------------------------------------------
def _tp_info(group) -> tuple[int, int]:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _gather_stats(stats: torch.Tensor, group, tp: int) -> torch.Tensor:
    """The only collective of a call: all_gather the ``[T, 4]`` stats into ``[tp, T, 4]``."""
    if tp == 1:
        return stats.unsqueeze(0)
    out = torch.empty((tp * stats.shape[0], stats.shape[1]), dtype=stats.dtype,
                      device=stats.device)
    # torch >= 2.13 renamed all_gather_into_tensor (still there, deprecated) to all_gather_single.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, stats.contiguous(), group=group)
    return out.view(tp, *stats.shape)


def _combine(stats: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``[tp, T, 4]`` stats -> (logp, entropy, M, log S, W / S), each ``[T]`` fp32.

    The backward gets ``M``, ``log S`` and ``W / S = mu - M`` rather than ``lse`` and ``mu``, so
    it can form ``z - M`` first: for logits ~1e4 that keeps p accurate to fp32 rounding.
    """
    m, s, zt, w = stats.unbind(dim=-1)
    big_m = m.amax(dim=0)
    scale = torch.exp(m - big_m)
    big_s = (s * scale).sum(dim=0)
    big_w = (scale * (w + s * (m - big_m))).sum(dim=0)
    log_s = torch.log(big_s)
    mean_shift = big_w / big_s  # E_p[z] - M
    logp = (zt.sum(dim=0) - big_m) - log_s
    return logp, log_s - mean_shift, big_m, log_s, mean_shift


class VocabParallelLogProb(torch.autograd.Function):
    """Autograd wrapper; ``path`` is "triton" or "torch" (already resolved)."""

    @staticmethod
    def forward(ctx, logits, target, ignore_mask, temperature, group, with_entropy,
                inplace_backward, path):
        tp, rank = _tp_info(group)
        vocab_start = rank * logits.shape[1]
        inv_temp = 1.0 / temperature
        stats_fn = _triton_stats if path == "triton" else _torch_stats
        stats = stats_fn(logits, target, vocab_start, inv_temp, with_entropy)
        logp, entropy, big_m, log_s, shift = _combine(_gather_stats(stats, group, tp))
        keep = ~ignore_mask
        logp = torch.where(keep, logp, 0.0)
        entropy = torch.where(keep, entropy, 0.0) if with_entropy else torch.zeros_like(logp)
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
        keep = ~ignore_mask
        g_logp = torch.where(keep, g_logp, 0.0) if g_logp is not None else torch.zeros_like(log_s)
        g_ent = torch.where(keep, g_ent, 0.0) if (g_ent is not None and with_entropy) else None
        grad = logits.detach() if inplace else torch.empty_like(logits)
        bwd = _triton_backward if path == "triton" else _torch_backward
        bwd(logits, grad, target, big_m, log_s, shift, g_logp.float().contiguous(),
            None if g_ent is None else g_ent.float().contiguous(), vocab_start, inv_temp)
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
