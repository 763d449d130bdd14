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
same combine ``_vocab_stats.combine`` applies across tensor-parallel ranks. After the loop the
``[T, 4]`` stats go through exactly the logits path's TP combine (``_vocab_stats.gather_stats``
and ``combine``): log-prob, entropy and the normalisers ``M``, ``log S``, ``E_p[z] - M``.

Backward (of ``fused_output_logprob``: scoring and losses that are not token-separable)
recomputes every chunk's logits, turns them in place into their gradient with the
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

Gradient in the forward (``fused_output_token_loss``, ``fused_output_grpo_weighted_loss``; the
training path). The recomputing backward above runs four output-layer-sized matmuls (forward
logits, recomputed logits, ``dh``, ``dW``) against the logits path's three. When the loss is
``sum_t c_t * loss_t(logp_t, entropy_t)`` - token-separable, with weights ``c`` known up front
(every megagrpo loss aggregation is linear in the per-token loss: ``algo.aggregation_weights``) -
the gradient is known as soon as a token's statistics are, so (as Liger's fused-linear
cross-entropy does) the forward computes it, token-outer: for each chunk of ``Tc`` tokens

    z = (h_t @ W^T) / temperature      the chunk's logits over the shard's whole vocab slice
    stats -> all_gather -> combine     logp, entropy, normalisers of these Tc tokens
    d sum(c loss) / d (logp, entropy)  autograd on the small [Tc] graph of the per-token loss
    z <- dz in place                   the logits path's row backward (torch or Triton)
    dh_t = dz @ W;  dW += dz^T @ h_t   fp32 accumulators

Three matmuls in all; backward only scales the saved ``dh``/``dW`` by the scalar grad_output
(and all-reduces ``dh`` over TP), then frees them; a second backward raises. ``Tc`` keeps a
chunk at <= 1/CHUNK_SHARE of the logits (``grad_chunk_tokens``). Costs: collectives trade
count for the matmul - forward ONE all_gather of ``[Tc, 4]`` per token chunk (``ceil(T/Tc)``,
~32 for large calls, instead of one of ``[T, 4]``; the same bytes in all), backward ONE
all_reduce of ``dh`` as before. Memory: ``dh`` and ``dW`` live from forward to backward (on the
last pipeline stage 1F1B runs a micro-batch's forward and backward back to back, so one set is
in flight); for fp32 weights they are the outputs themselves, for bf16 ``dW``'s fp32 accumulator
is ``4 V_local H`` bytes more than the bf16 output. Without grad (``torch.no_grad`` or inputs
that do not require it) the op runs the forward statistics only (one matmul per chunk). Not
token-separable, so kept on the recomputing path: GSPO (``ratio_level="sequence"``: a token's
ratio is its sequence's mean log-ratio).

Paths (``dispatch.resolve_impl``, logged once): "torch" runs the per-chunk statistics and
gradient with the chunked torch code of ``logprob``; "triton" with its Triton kernels, each
chunk's matmuls being cuBLAS (``torch.mm``) on GPU. ``reference_output_logprob`` is the
float64 full-logits reference (tests, benchmark baseline).
"""
from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from . import _vocab_stats as vs
from .dispatch import VocabPass, resolve_impl
from .grpo_loss import LossSpec, TokenInputs, from_keywords, loss_from_logp
from .logprob import CHUNK_ELEMS as ROW_CHUNK_ELEMS

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
CHUNK_ALIGN_CUDA = 128
"""On GPU (``CUDA_RULES`` "v2") a default chunk's vocab width ``Vc`` is a multiple of this
(unless it is the whole shard): ``Vc`` is the row length of the ``[Tc, Vc]`` logits chunk that
three of the four GEMMs read or write, and cuBLAS's tensor-core kernels want 16-byte aligned
rows. H200, bf16, V 151,936, (Tc, Vc) = (4096, 4748) against (4096, 4736)
(benchmarks/results/fused_output_probe_h200.jsonl): 28.4 / 19.8 ms (H 1024, T 4096),
110 / 78 ms (H 1024, T 16384), 88 / 35 ms and 353 / 167 ms (H 4096)."""
CHUNK_TOKENS_CUDA_V2 = 16384
CHUNK_ELEMS_CUDA_V2 = 1 << 27
CHUNK_FLOOR_CUDA = 1 << 26
"""GPU chunks (``CUDA_RULES`` "v2"): up to 16384 tokens, and 1/CHUNK_SHARE of the logits as
before but at least CHUNK_FLOOR_CUDA values (128 MiB in bf16, 0.1% of an H200) and at most
CHUNK_ELEMS_CUDA_V2. The recomputing loop is bound by the host's launches (~22 per chunk, incl.
two Triton kernels, ~25 us each) until its chunks are big: on the H200 (bf16, H 1024, V 151,936,
the probe above) the host took 19 of the 20 ms at (4096, 4736); at T=4096 (4096, 8192 / 32768)
took 15.4 / 9.2 ms, at T=16384 (4096, 8192 / 32768) and (16384, 8192) 60.6 / 38.8 / 37.2 ms
(the logits path: 6.4 and 26.6 ms); at H 4096 the same shapes were within 7% of each other
(GEMM-bound). v2 gives (4096, 16384) at T=4096 and (16384, 4736) at T=16384 (32 chunks, ~2x
the launches of (16384, 8192) but within 1/32 of the logits); v1 (CHUNK_TOKENS_CUDA,
CHUNK_ELEMS_CUDA) made 32-152 chunks of 4096 tokens."""
CUDA_RULES = "v2"
""""v2": the GPU chunk rules measured on the H200 (CHUNK_ALIGN_CUDA, CHUNK_*_CUDA_V2 and FLOOR,
GRAD_MIN_TOKENS_CUDA, GRAD_CHUNK_ELEMS_CUDA, DW_BLOCK_ROWS_CUDA); "v1": the CPU-tuned ones of
before, kept so that ``benchmarks/fused_output.py --sweep`` compares the two. The CPU rules are
the same under both."""


def chunk_shape(n_rows: int, n_cols: int, cuda: bool, chunk_tokens: int | None = None,
                chunk_vocab: int | None = None) -> tuple[int, int]:
    """(Tc, Vc) of the logits chunks for ``n_rows`` tokens and ``n_cols`` vocab columns, on a
    GPU (``cuda``) or the CPU (the planner reads it too)."""
    if cuda and CUDA_RULES != "v1":
        tc = chunk_tokens or min(max(n_rows, 1), CHUNK_TOKENS_CUDA_V2)
        budget = min(CHUNK_ELEMS_CUDA_V2, max(CHUNK_FLOOR_CUDA, n_rows * n_cols // CHUNK_SHARE))
        vc = chunk_vocab or max(CHUNK_ALIGN_CUDA, budget // tc
                                // CHUNK_ALIGN_CUDA * CHUNK_ALIGN_CUDA)
        return max(1, tc), max(1, min(vc, max(n_cols, 1)))
    tc = chunk_tokens or min(max(n_rows, 1), CHUNK_TOKENS_CUDA if cuda else CHUNK_TOKENS)
    budget = min(CHUNK_ELEMS_CUDA if cuda else CHUNK_ELEMS,
                 max(MIN_CHUNK_ELEMS, n_rows * n_cols // CHUNK_SHARE))
    vc = chunk_vocab or max(MIN_CHUNK_VOCAB, budget // tc)
    return max(1, tc), max(1, min(vc, max(n_cols, 1)))


GRAD_CHUNK_ELEMS = 1 << 25
"""Cap of the gradient-in-forward path's chunks ``[Tc, V_local]`` (CPU and GPU; 128 MiB fp32):
below it the chunk is 1/CHUNK_SHARE of the logits. The path streams the whole weight once per
chunk for each of its three matmuls (and the fp32 ``dW`` accumulator once), so it wants the
widest chunk the memory target allows: on the 2-core AVX-512 CPU, a [Tc, 151936] x [151936,
1024] chunk ran its three matmuls at 5.0 / 4.3 / 3.3 ms per token at Tc = 32 / 64 / 128
(fp32; the logits path's full-size matmuls ~4 ms per token)."""


GRAD_MIN_TOKENS = 192
"""The gradient-in-forward path runs when its chunks hold at least this many tokens (or all of
them): each chunk streams the whole weight shard through its three matmuls (and the ``dW``
accumulator once), so thin chunks are bound by memory traffic, not FLOPs. On the 2-core AVX-512
CPU (fp32, V_local 151,936, H 1024) the three chunk matmuls cost 5.5 / 4.5 / 3.4 / 2.7 ms per
token at Tc = 32 / 64 / 128 / 256 against 2.5 for full-size ones; end to end (benchmarks/
fused_output.py) the three-matmul path took 1.4-2.0x the recomputing one at Tc = 32-64, 1.15x
at Tc = 128 (TP=2, T=4096) and 0.95x at Tc = 220 (TP=1, T=8192: the GRAD_CHUNK_ELEMS cap). At
1/32 of the logits per chunk that is T >= ~6000."""
GRAD_MIN_TOKENS_CUDA = 2048
"""The same threshold on GPU (``CUDA_RULES`` "v2"; "v1" used GRAD_MIN_TOKENS): every token chunk
reads and writes the whole fp32 ``dW`` accumulator and launches the small per-token loss graph,
so thin chunks are bound by the host. H200, bf16, V 151,936, forced on (the probe's NLL loss):
Tc = 128 took 142 ms at T=4096 (H 1024; the host 141 ms: 75 dW blocks per chunk), 54 ms with
DW_BLOCK_ROWS_CUDA blocks; Tc = 1024 / 2048 / 4096 took 10.7 / 8.6 / 7.8 ms (T=4096) and 38.9 /
32.7 / 30.0 ms (T=16384), against the v2 recomputing chunks' 9.2 and 37.2 ms: a win from
2048 tokens (H 4096, T 16384: 133 / 114 / 104 ms against 133)."""
GRAD_CHUNK_ELEMS_CUDA = 1 << 29
"""Cap of the gradient-in-forward chunks on GPU (``CUDA_RULES`` "v2": 1 GiB of bf16 logits,
~3500 tokens at V_local 151,936), without the 1/32 share."""


def use_grad_in_forward(n_rows: int, tc: int, hidden_size: int = 0, itemsize: int = 4,
                        cuda: bool = False) -> bool:
    """True when chunks of ``tc`` of ``n_rows`` tokens are wide enough for the three-matmul
    path (GRAD_MIN_TOKENS, on GPU GRAD_MIN_TOKENS_CUDA, or one chunk holding every token) and,
    for weights below fp32 (``itemsize`` bytes), its fp32 ``dW`` accumulator (``4 V_local H``
    bytes, held from forward to backward) is within 1/CHUNK_SHARE of the logits
    (``n_rows V_local itemsize``): bf16 needs T >= 64 H. (In bf16 on the CPU it was also 4x
    slower than recomputing at T=1024: adding each chunk's product into the fp32 accumulator is
    bound by memory traffic.)"""
    if itemsize < 4 and 4 * hidden_size * CHUNK_SHARE > n_rows * itemsize:
        return False
    least = GRAD_MIN_TOKENS_CUDA if cuda and CUDA_RULES != "v1" else GRAD_MIN_TOKENS
    return tc >= min(n_rows, least)


def grad_chunk_tokens(n_rows: int, n_cols: int, chunk_tokens: int | None = None,
                      cuda: bool = False) -> int:
    """Tokens per chunk of the gradient-in-forward path, whose chunks span all ``n_cols`` vocab
    columns of the shard: at most 1/CHUNK_SHARE of the logits (MIN_CHUNK_ELEMS for small calls)
    and GRAD_CHUNK_ELEMS values; on GPU (v2) GRAD_CHUNK_ELEMS_CUDA values."""
    if chunk_tokens:
        return max(1, chunk_tokens)
    if cuda and CUDA_RULES != "v1":
        budget = GRAD_CHUNK_ELEMS_CUDA
    else:
        budget = min(GRAD_CHUNK_ELEMS, max(MIN_CHUNK_ELEMS, n_rows * n_cols // CHUNK_SHARE))
    return max(1, min(max(n_rows, 1), budget // max(n_cols, 1)))


def _merge_stats(acc: torch.Tensor, new: torch.Tensor) -> None:
    """``acc <- merge(acc, new)`` for ``[n, 4]`` (m, s, zt, w) rows of two disjoint vocab
    ranges: the chunk-to-chunk twin of ``_vocab_stats.combine``'s rank-to-rank rescaling."""
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
    """(stats, backward) of one logits chunk: the Triton kernels, or the torch row passes on
    cache-sized slices of the chunk's rows (ROW_CHUNK_ELEMS fp32 values each)."""
    return vs.row_fns(path, max(1, ROW_CHUNK_ELEMS // max(vc, 1)))


def _accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b``; ``acc`` fp32 (or, zero and in the inputs' dtype, the product's
    destination), ``a``/``b`` in the inputs' dtype (product in it too)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    else:
        acc.add_(a @ b)


def _forward_stats(hidden, weight, target, vocab_start, valid, inv_temp, with_entropy, shape,
                   path) -> torch.Tensor:
    """This rank's ``[T, 4]`` stats over its ``valid`` vocab columns, chunk by chunk."""
    n = hidden.shape[0]
    tc, vc = shape
    stats = torch.zeros((n, vs.NUM_STATS), dtype=torch.float32, device=hidden.device)
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
    # dW's rows of a vocab chunk sum over the token chunks: in place for fp32 weights, in an
    # fp32 accumulator otherwise, except with one token chunk (T <= Tc), where the one product
    # is written straight into dW (one GEMM rounding, as megatron's dW; no [Vc, H] fp32 buffer)
    direct = weight.dtype == torch.float32 or n <= tc
    bwd_fn = _row_fns(path, vc)[1]
    for c0 in range(0, valid, vc):
        c1 = min(c0 + vc, valid)
        w_c = weight[c0:c1]
        dw_c = None
        if need_dw and not direct:
            dw_c = torch.zeros(w_c.shape, dtype=torch.float32, device=w_c.device)
        for t0 in range(0, n, tc):
            t1 = min(t0 + tc, n)
            h_t = hidden[t0:t1]
            grad = h_t @ w_c.T  # the chunk's logits, overwritten with their gradient below
            bwd_fn(grad, grad, target[t0:t1], big_m[t0:t1], log_s[t0:t1], shift[t0:t1],
                   g_logp[t0:t1], None if g_ent is None else g_ent[t0:t1], vocab_start + c0,
                   inv_temp)
            if need_dh:
                _accumulate_mm(dh[t0:t1], grad, w_c)
            if need_dw and direct:
                _accumulate_mm(dw[c0:c1], grad.T, h_t)  # fp32: addmm_; else the one product
            elif need_dw:
                _accumulate_mm(dw_c, grad.T, h_t)
            del grad
        if dw_c is not None:
            dw[c0:c1] = dw_c
    return dh, dw


class FusedOutputLogProb(torch.autograd.Function):
    """Autograd wrapper; ``path`` is "triton" or "torch" (already resolved)."""

    @staticmethod
    def forward(ctx, hidden, weight, target, ignore_mask, temperature, group, with_entropy,
                valid, shape, path):
        tp, rank = vs.tp_info(group)
        vocab_start = rank * weight.shape[0]  # the padded shard width sets the global ids
        inv_temp = 1.0 / temperature
        with torch.no_grad():
            stats = _forward_stats(hidden, weight, target, vocab_start, valid, inv_temp,
                                   with_entropy, shape, path)
        logp, entropy, big_m, log_s, shift = vs.reduce_stats(stats, group, tp, ~ignore_mask,
                                                             with_entropy)
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
        g_logp, g_ent = vs.masked_grads(~ignore_mask, g_logp, g_ent, with_entropy)
        with torch.no_grad():
            dh, dw = _backward(hidden, weight, target, vocab_start, valid, inv_temp, big_m, log_s,
                               shift, g_logp, g_ent, shape, path, need_dh, need_dw)
            if dh is not None and tp > 1:
                dist.all_reduce(dh, group=group)  # the call's only backward collective
        return None if dh is None else dh.to(hidden.dtype), dw, *nones


DW_BLOCK_ROWS = 2048
"""Vocab rows per block of a low-precision ``dW`` product on its way into the fp32 accumulator
(one reused ``[DW_BLOCK_ROWS, H]`` buffer; a fresh ``[V_local, H]`` product per chunk cost
~0.2-0.5 s of page faults and memory traffic on the CPU)."""
DW_BLOCK_ROWS_CUDA = 16384
"""The same on GPU (``CUDA_RULES`` "v2"): 10 blocks of a 152k shard per token chunk, not 75
(each block is a GEMM and an add: 150 launches per chunk with 2048 rows; H200, 128-token
chunks, T=4096, H 1024: 142 ms with 2048 rows, 54 ms with 16384)."""


def _accumulate_dw(dw32: torch.Tensor, grad: torch.Tensor, h_t: torch.Tensor,
                   buf: torch.Tensor | None) -> None:
    """``dw32 [V, H] fp32 += grad^T @ h_t`` (grad ``[Tc, V]``, h_t ``[Tc, H]``): fp32 inputs in
    place; otherwise each vocab block's product in the inputs' dtype (one GEMM rounding, as
    megatron's dW), added in fp32."""
    if buf is None:
        dw32.addmm_(grad.T, h_t)
        return
    step = buf.shape[0]
    for v0 in range(0, grad.shape[1], step):
        v1 = min(v0 + step, grad.shape[1])
        out = buf[:v1 - v0]
        torch.mm(grad[:, v0:v1].T, h_t, out=out)
        dw32[v0:v1].add_(out)


def _token_grads(token_loss, logp, entropy, token_weight, rows):
    """(per-token loss, d/d logp, d/d entropy or None) of ``sum(token_weight * token_loss)`` on
    one chunk: autograd on the small ``[Tc]`` graph (None: the loss ignores the entropy)."""
    with torch.enable_grad():
        lp = logp.detach().requires_grad_()
        ent = entropy.detach().requires_grad_()
        tok = token_loss(lp, ent, rows)
        g_lp, g_ent = torch.autograd.grad((tok * token_weight).sum(), (lp, ent),
                                          allow_unused=True)
    return tok.detach(), torch.zeros_like(logp) if g_lp is None else g_lp, g_ent


def _loss_and_grads(hidden, weight, target, token_weight, keep, vocab_start, valid, inv_temp,
                    tc, path, group, tp, token_loss, need_dh, need_dw):
    """One pass over token chunks: loss (fp32 scalar), logp, entropy ``[T]`` and the loss's
    gradients dh ``[T, H]`` fp32 (this shard's part) and dW ``[V_local, H]`` (fp32, or the
    output itself for fp32 weights), each chunk's logits turned into their gradient in place."""
    n, dev = hidden.shape[0], hidden.device
    stats_fn, bwd_fn = _row_fns(path, valid)
    w = weight[:valid]
    logp = torch.zeros(n, dtype=torch.float32, device=dev)
    entropy = torch.zeros_like(logp)
    loss = torch.zeros((), dtype=torch.float32, device=dev)
    dh = torch.zeros(hidden.shape, dtype=torch.float32, device=dev) if need_dh else None
    dw = torch.zeros(weight.shape, dtype=torch.float32, device=dev) if need_dw else None
    low = need_dw and valid > 0 and weight.dtype != torch.float32
    rows_per_block = (DW_BLOCK_ROWS_CUDA if dev.type == "cuda" and CUDA_RULES != "v1"
                      else DW_BLOCK_ROWS)
    buf = torch.empty((min(rows_per_block, valid), weight.shape[1]), dtype=weight.dtype,
                      device=dev) if low else None
    for t0 in range(0, n, tc):
        rows = slice(t0, min(t0 + tc, n))
        h_t, tgt, k = hidden[rows], target[rows], keep[rows]
        z = h_t @ w.T if valid else None  # matmul 1: the chunk's logits over the whole shard
        local = (stats_fn(z, tgt, vocab_start, inv_temp, True) if valid else  # padding only
                 torch.tensor(vs.EMPTY_STATS, device=dev).expand(h_t.shape[0], -1))
        lp, ent, big_m, log_s, shift = vs.reduce_stats(local, group, tp, k, True)
        tok, g_lp, g_ent = _token_grads(token_loss, lp, ent, token_weight[rows], rows)
        logp[rows], entropy[rows] = lp, ent
        loss += (tok * token_weight[rows]).sum()
        if valid and (need_dh or need_dw):
            g_ent = None if g_ent is None else torch.where(k, g_ent, 0.0).contiguous()
            bwd_fn(z, z, tgt, big_m, log_s, shift, torch.where(k, g_lp, 0.0).contiguous(),
                   g_ent, vocab_start, inv_temp)  # z <- d loss / d z, in place
            if need_dh:  # matmul 2
                _accumulate_mm(dh[rows], z, w)
            if need_dw:  # matmul 3
                _accumulate_dw(dw[:valid], z, h_t, buf)
        del z
    return loss, logp, entropy, dh, dw


class FusedOutputLoss(torch.autograd.Function):
    """``sum_t token_weight_t * token_loss(logp_t, entropy_t)`` with its gradient computed in the
    forward (see the module docstring); ``path`` is "triton" or "torch" (already resolved)."""

    @staticmethod
    def forward(ctx, hidden, weight, target, token_weight, ignore_mask, temperature, group,
                valid, tc, path, token_loss):
        tp, rank = vs.tp_info(group)
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.no_grad():
            loss, logp, entropy, dh, dw = _loss_and_grads(
                hidden, weight, target, token_weight, ~ignore_mask, rank * weight.shape[0],
                valid, 1.0 / temperature, tc, path, group, tp, token_loss, need_dh, need_dw)
        ctx.grads = (dh, dw)  # d loss / d (h, W) for grad_output 1; freed by backward
        ctx.args = (group, tp, hidden.dtype, weight.dtype)
        ctx.mark_non_differentiable(logp, entropy)
        return loss, logp, entropy

    @staticmethod
    def backward(ctx, g_loss, _g_logp, _g_entropy):
        if ctx.grads is None:
            raise RuntimeError("FusedOutputLoss: backward runs once (its gradients were "
                               "computed in the forward and are freed by the first backward)")
        dh, dw = ctx.grads
        ctx.grads = None
        group, tp, h_dtype, w_dtype = ctx.args
        nones = (None,) * 9
        if g_loss is None:
            return None, None, *nones
        with torch.no_grad():
            if dh is not None:
                dh.mul_(g_loss)
                if tp > 1:
                    dist.all_reduce(dh, group=group)  # the call's only backward collective
                dh = dh.to(h_dtype)
            if dw is not None:
                dw = dw.mul_(g_loss).to(w_dtype)
        return dh, dw, *nones


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


def nll_token_loss(logp: torch.Tensor, entropy: torch.Tensor, rows: slice) -> torch.Tensor:
    """Negative log-likelihood per token: ``fused_output_token_loss``'s default."""
    return -logp


def fused_output_token_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    token_weight: torch.Tensor,
    token_loss=nll_token_loss,
    *,
    temperature: float = 1.0,
    group: "dist.ProcessGroup | None" = None,
    ignore_mask: torch.Tensor | None = None,
    valid_vocab: int | None = None,
    impl: str = "auto",
    chunk_tokens: int | None = None,
    grad_in_forward: bool | None = None,
    chunk_vocab: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``loss = sum_t token_weight_t * token_loss(logp, entropy, rows)_t`` from hidden states,
    its gradient computed in the forward (three output-layer matmuls, module docstring) where
    that is the faster path.

    Args:
        hidden, weight, target, temperature, group, ignore_mask, valid_vocab, impl: as
            ``fused_output_logprob``.
        token_weight: ``[T]`` fp32, the weight of each token's loss (e.g. the loss
            aggregation's ``d loss / d token_loss``); no gradient flows into it.
        token_loss: ``(logp [Tc], entropy [Tc], rows) -> [Tc]``, the per-token loss of the
            tokens ``rows`` (a slice of ``[0, T)``) from their log-probs and entropies. It must
            be token-separable (token t's loss depends on token t's logp and entropy only):
            it runs chunk by chunk. Default: ``-logp``.
        chunk_tokens: tokens per chunk (None = ``grad_chunk_tokens``; on the recomputing
            path ``chunk_shape``'s).
        chunk_vocab: vocab rows per chunk of the recomputing path (None = ``chunk_shape``'s).
        grad_in_forward: True / False force the gradient-in-forward / the recomputing path;
            None = ``use_grad_in_forward`` (chunks of at least GRAD_MIN_TOKENS tokens; for
            bf16 weights also T >= 64 H).

    Returns:
        ``(loss, logp, entropy)``: loss an fp32 scalar, differentiable w.r.t. ``hidden`` and
        ``weight``; logp, entropy ``[T]`` fp32, detached. Without grad (``torch.no_grad`` or
        neither input requiring it) no gradient work is done: the forward statistics only.
    """
    op = "fused_output_token_loss"
    hidden, weight, valid, path = _prepare(hidden, weight, target, temperature, valid_vocab,
                                           impl, op)
    dev = hidden.device
    ignore_mask = (torch.zeros(target.shape, dtype=torch.bool, device=dev) if ignore_mask is None
                   else ignore_mask.to(dev, torch.bool))
    token_weight = token_weight.to(dev, torch.float32).detach()
    target = target.to(dev, torch.long).contiguous()
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        logp, entropy = fused_output_logprob(
            hidden, weight, target, temperature=temperature, group=group, ignore_mask=ignore_mask,
            with_entropy=True, valid_vocab=valid, impl=path, chunk_tokens=chunk_tokens,
            chunk_vocab=chunk_vocab)
        tok = token_loss(logp, entropy, slice(0, target.shape[0]))
        return (tok * token_weight).sum(), logp, entropy
    # the shard's padded width, not `valid`: every rank of the group must cut the same chunks
    cuda = dev.type == "cuda"
    tc = grad_chunk_tokens(hidden.shape[0], weight.shape[0], chunk_tokens, cuda)
    auto = use_grad_in_forward(hidden.shape[0], tc, weight.shape[1], weight.element_size(), cuda)
    if not (auto if grad_in_forward is None else grad_in_forward):
        logp, entropy = fused_output_logprob(
            hidden, weight, target, temperature=temperature, group=group, ignore_mask=ignore_mask,
            with_entropy=True, valid_vocab=valid, impl=path, chunk_tokens=chunk_tokens,
            chunk_vocab=chunk_vocab)
        tok = token_loss(logp, entropy, slice(0, target.shape[0]))
        return (tok * token_weight).sum(), logp.detach(), entropy.detach()
    return FusedOutputLoss.apply(hidden, weight, target, token_weight, ignore_mask,
                                 float(temperature), group, valid, tc, path, token_loss)


def _grpo_chunk_loss(logp: torch.Tensor, entropy: torch.Tensor, rows: slice, *,
                     spec: LossSpec, inputs: TokenInputs) -> torch.Tensor:
    """``loss_from_logp``'s per-token loss ``[Tc]`` of the tokens ``rows`` (token-level ratio;
    the inputs were checked once by the caller)."""
    return loss_from_logp(spec, inputs.rows(rows), logp, entropy)[0]


def grpo_hidden_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    spec: LossSpec,
    inputs: TokenInputs,
    token_weight: torch.Tensor | None = None,
    run: VocabPass = VocabPass(),
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO per-token loss (``grpo_loss.loss_from_logp``) from hidden states ``[T, H]``
    and this rank's weight ``[V_local, H]`` (as in ``fused_output_logprob``; ``run`` says how:
    group, path, padding rows, chunks).

    Without ``token_weight``: the loss ``[T]``, differentiable through the recomputing
    backward (four output-layer matmuls). With ``token_weight`` ``[T]`` (the aggregation's
    ``d loss / d loss_t``): the scalar ``sum_t token_weight_t loss_t``; token-level ratios
    (GRPO, DAPO, Dr. GRPO, BNPO, CISPO, SAPO; any clip, KL, IS weight) run
    ``fused_output_token_loss``, the gradient in the forward (three matmuls; ``run``'s
    ``grad_in_forward`` as there); GSPO (``ratio_level="sequence"``) is not token-separable -
    a token's loss depends on its whole sequence's log-probs - and recomputes.

    Returns:
        ``(loss, token_loss, metrics)``: the loss above, the detached per-token loss ``[T]``
        and the metrics of ``loss_from_logp``.
    """
    spec.check(inputs)
    mask = inputs.mask.to(hidden.device, torch.bool)
    inputs = inputs._replace(mask=mask)
    common = dict(temperature=spec.temperature, group=run.group, valid_vocab=run.valid_vocab,
                  impl=run.impl, chunk_tokens=run.chunk_tokens)
    if token_weight is None or not spec.token_separable:
        logp, entropy = fused_output_logprob(hidden, weight, target, ignore_mask=~mask,
                                             with_entropy=True, chunk_vocab=run.chunk_vocab,
                                             **common)
        tok_loss, metrics = loss_from_logp(spec, inputs, logp, entropy)
        if token_weight is None:
            return tok_loss, tok_loss.detach(), metrics
        w = token_weight.detach().to(hidden.device, torch.float32)
        return (tok_loss * w).sum(), tok_loss.detach(), metrics
    chunk_loss = partial(_grpo_chunk_loss, spec=spec, inputs=inputs)
    loss, logp, entropy = fused_output_token_loss(hidden, weight, target, token_weight,
                                                  chunk_loss, ignore_mask=~mask,
                                                  grad_in_forward=run.grad_in_forward,
                                                  chunk_vocab=run.chunk_vocab, **common)
    with torch.no_grad():  # O(T): the per-token loss and metrics from the op's log-probs
        tok_loss, metrics = loss_from_logp(spec, inputs, logp, entropy)
    return loss, tok_loss, metrics


def fused_output_grpo_loss(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                           old_logp: torch.Tensor | None, advantages: torch.Tensor,
                           mask: torch.Tensor, **keywords
                           ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Thin keyword form of ``grpo_hidden_loss`` without token weights: ``(loss [T], metrics)``;
    ``keywords`` as ``grpo_loss.from_keywords`` (the loss options, ``ref_logp`` ...)."""
    spec, inputs, run = from_keywords(old_logp, advantages, mask, keywords)
    loss, _, metrics = grpo_hidden_loss(hidden, weight, target, spec, inputs, None, run)
    return loss, metrics


def fused_output_grpo_weighted_loss(hidden: torch.Tensor, weight: torch.Tensor,
                                    target: torch.Tensor, old_logp: torch.Tensor | None,
                                    advantages: torch.Tensor, mask: torch.Tensor,
                                    token_weight: torch.Tensor, **keywords
                                    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Thin keyword form of ``grpo_hidden_loss`` with ``token_weight``: ``(loss, token_loss,
    metrics)``; ``keywords`` as ``grpo_loss.from_keywords``."""
    spec, inputs, run = from_keywords(old_logp, advantages, mask, keywords)
    return grpo_hidden_loss(hidden, weight, target, spec, inputs, token_weight, run)


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
