"""Per-row vocab statistics shared by the logits op (``logprob``) and the fused output layer
(``fused_output``): their Triton and chunked-torch forward/backward row passes and the
tensor-parallel gather + combine. Private: the public ops are in ``logprob``, ``fused_output``
and ``ops``; see ``logprob``'s module docstring for the math.

Per row of ``z = logits / temperature`` over a vocab slice, four fp32 statistics ``[T, 4]``:
``m`` (max), ``s`` (sum exp(z - m)), ``zt`` (the target's logit where it is in the slice, else
0) and ``w`` (sum exp(z - m) (z - m), with entropy only). ``combine`` merges the slices of all
ranks; the row backward turns a chunk of logits into ``d / d logits`` of
``g logp + h entropy`` from the combined normalisers, in place or into another buffer.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from .dispatch import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

MAX_BLOCK_V = 4096
NUM_STATS = 4  # m, s, zt, w
EMPTY_STATS = (-3.0e38, 0.0, 0.0, 0.0)
"""(m, s, zt, w) of an empty vocab slice: weight exp(m - M) = 0 in every combine (a finite
"minus infinity" keeps exp(m - M) * 0 free of NaNs)."""

# --------------------------------------------------------------------------------------------
# Triton kernels (one program per row; the row is streamed in BLOCK_V-wide blocks)
# --------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def logprob_fwd_kernel(
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
    def logprob_bwd_kernel(
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


def triton_stats(
    logits: torch.Tensor, target: torch.Tensor, vocab_start: int, inv_temp: float,
    with_entropy: bool,
) -> torch.Tensor:
    """Per-row local stats ``[T, 4]`` fp32 (m, s, zt, w) via the Triton forward kernel."""
    n_rows, n_cols = logits.shape
    stats = torch.empty((n_rows, NUM_STATS), dtype=torch.float32, device=logits.device)
    if n_rows == 0:
        return stats
    block_v = _block_v(n_cols)
    logprob_fwd_kernel[(n_rows,)](
        logits, logits.stride(0), target, stats, n_cols, vocab_start, inv_temp,
        WITH_ENTROPY=with_entropy, BLOCK_V=block_v, num_warps=_num_warps(block_v),
    )
    return stats


def triton_backward(
    logits: torch.Tensor, grad: torch.Tensor, target: torch.Tensor, big_m: torch.Tensor,
    log_s: torch.Tensor, shift: torch.Tensor, g_logp: torch.Tensor, g_ent: torch.Tensor | None,
    vocab_start: int, inv_temp: float,
) -> None:
    """Write the gradient w.r.t. the local logits into ``grad`` (may be ``logits`` itself)."""
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    block_v = _block_v(n_cols)
    logprob_bwd_kernel[(n_rows,)](
        logits, logits.stride(0), grad, grad.stride(0), target, big_m, log_s, shift, g_logp,
        g_logp if g_ent is None else g_ent, n_cols, vocab_start, inv_temp,
        WITH_ENTROPY_GRAD=g_ent is not None, BLOCK_V=block_v, num_warps=_num_warps(block_v),
    )




def _scaled_fp32(x: torch.Tensor, inv_temp: float) -> torch.Tensor:
    """``x / temperature`` as a fresh fp32 buffer (never an alias of the caller's logits)."""
    z = torch.empty(x.shape, dtype=torch.float32, device=x.device).copy_(x)
    return z if inv_temp == 1.0 else z.mul_(inv_temp)


def _local_target(target: torch.Tensor, vocab_start: int, n_cols: int):
    local = target - vocab_start
    is_local = (local >= 0) & (local < n_cols)
    return local.clamp(0, max(n_cols - 1, 0)), is_local


def torch_stats(
    logits: torch.Tensor, target: torch.Tensor, vocab_start: int, inv_temp: float,
    with_entropy: bool, chunk_rows: int,
) -> torch.Tensor:
    """Per-row local stats ``[T, 4]`` fp32 (m, s, zt, w), ``chunk_rows`` rows at a time (the
    caller sizes the chunks: its fp32 buffers are ``[chunk_rows, V_local]``)."""
    n_rows, n_cols = logits.shape
    stats = torch.zeros((n_rows, NUM_STATS), dtype=torch.float32, device=logits.device)
    step = max(1, chunk_rows)
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


def torch_backward(
    logits: torch.Tensor, grad: torch.Tensor, target: torch.Tensor, big_m: torch.Tensor,
    log_s: torch.Tensor, shift: torch.Tensor, g_logp: torch.Tensor, g_ent: torch.Tensor | None,
    vocab_start: int, inv_temp: float, chunk_rows: int,
) -> None:
    """Chunked twin of ``triton_backward``: at most two fp32 chunk buffers
    ``[chunk_rows, V_local]`` are live."""
    n_rows, n_cols = logits.shape
    step = max(1, chunk_rows)
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
# Cross-rank combine
# --------------------------------------------------------------------------------------------
def tp_info(group) -> tuple[int, int]:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def gather_stats(stats: torch.Tensor, group, tp: int) -> torch.Tensor:
    """The only collective of a call: all_gather the ``[T, 4]`` stats into ``[tp, T, 4]``."""
    if tp == 1:
        return stats.unsqueeze(0)
    out = torch.empty((tp * stats.shape[0], stats.shape[1]), dtype=stats.dtype,
                      device=stats.device)
    # torch >= 2.13 renamed all_gather_into_tensor (still there, deprecated) to all_gather_single.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, stats.contiguous(), group=group)
    return out.view(tp, *stats.shape)


def combine(stats: torch.Tensor) -> tuple[torch.Tensor, ...]:
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



def row_fns(path: str, chunk_rows: int):
    """(stats, backward) row passes of ``path`` ("triton" | "torch"), with the signatures of
    ``triton_stats`` / ``triton_backward``; the torch path works ``chunk_rows`` rows at a time."""
    if path == "triton":
        return triton_stats, triton_backward
    return (partial(torch_stats, chunk_rows=chunk_rows),
            partial(torch_backward, chunk_rows=chunk_rows))


def reduce_stats(local: torch.Tensor, group, tp: int, keep: torch.Tensor, with_entropy: bool
                 ) -> tuple[torch.Tensor, ...]:
    """This rank's ``[T, 4]`` stats -> (logp, entropy, M, log S, W / S), each ``[T]`` fp32,
    gathered over ``group`` and combined; logp and entropy are 0 where ``keep`` ``[T]`` is
    False (entropy 0 everywhere without ``with_entropy``)."""
    logp, entropy, big_m, log_s, shift = combine(gather_stats(local, group, tp))
    logp = torch.where(keep, logp, 0.0)
    entropy = torch.where(keep, entropy, 0.0) if with_entropy else torch.zeros_like(logp)
    return logp, entropy, big_m, log_s, shift


def masked_grads(keep: torch.Tensor, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None,
                 with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The incoming ``[T]`` gradients of (logp, entropy) as contiguous fp32, 0 where ``keep`` is
    False (no gradient: zeros for logp, None for entropy)."""
    g_logp = (torch.where(keep, g_logp, 0.0) if g_logp is not None
              else torch.zeros(keep.shape, dtype=torch.float32, device=keep.device))
    g_ent = torch.where(keep, g_ent, 0.0) if (g_ent is not None and with_entropy) else None
    return g_logp.float().contiguous(), None if g_ent is None else g_ent.float().contiguous()
