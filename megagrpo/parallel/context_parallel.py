"""Context parallelism (parallel.cp) on megagrpo's own attention: each sequence split over the
ranks of a context-parallel (CP) group.

Layout (the load-balanced split of Llama 3's and megatron's CP training): a micro-batch's
width is padded on the right to a multiple of 2 x cp and cut into 2 x cp equal chunks; CP rank
r holds chunks r and 2cp-1-r of every row, so under a causal mask each rank does the same
attention work. Every CP rank holds the whole batch (CP ranks are one data replica, like TP
ranks); only the forward splits it:

- `ChunkSplit` cuts the micro-batch's per-token tensors (ids, targets, loss mask, old and
  reference log-probs, advantages, importance weights) to the rank's columns, and the RoPE
  table is read at those columns' global positions (`megagrpo.parallel.positions.RotaryPositions`;
  megatron's own per-CP-rank slicing of the table is switched off in `prepare_model`).
- Attention (`cp_attention`, called by `megagrpo.parallel.attention.SdpaAttention`): the keys and
  values are all-gathered over the CP group (backward: the gradient summed over the group, this
  rank's rows kept, i.e. a reduce-scatter) and each local query attends to the keys at global
  positions up to its own: the causal mask is exact.
- The loss runs per CP rank on its own tokens (the output layer and the fused output layer
  too) with the step's global normalisers, which every CP rank computes from the whole batch;
  a sequence-mean aggregation divides by each sequence's tokens over all chunks
  (`ChunkBatch.seq_tokens`). Each rank's loss is its share, and megatron's DDP sums the
  gradients over DP x CP (its 1/(dp x cp) scaling times the schedule's x cp for CP leaves the
  1/dp the losses already undo). The reports are made whole again (`ChunkSplit.report`):
  per-token log-probs all-gathered to [b, width], sums all-reduced over CP.

Packed micro-batches (`PackedRows`, compute.pack_sequences) are split row by row: each row
padded to a multiple of 2 x cp of its own length and cut into 2 x cp chunks of c_i tokens, CP
rank r holding chunks r and 2cp-1-r of every row, laid end to end (`ChunkRows`; the per-token
tensors are cut to each row's own columns, `row_columns`). Attention all-gathers the
micro-batch's packed keys and values once per layer, puts every row back in global order
(`kv_order`) and runs the same chunk blocks with each row's own offsets
(`cp_packed_attention`): a query sees only its own row's keys up to its position. GSPO's
sequence ratio, which needs the whole sequence's log-ratio inside the per-token loss, sums it
over the CP group inside the loss (`megagrpo.kernels.SequenceSplit`: the sums all-reduced
forward, their gradient backward), padded or packed.
On GPU megatron-core's Transformer Engine attention would do the attention part; that path is
not wired in (parallel.transformer_impl='transformer_engine' is refused with cp > 1).
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, fields, replace

import torch
import torch.distributed as dist
from torch import Tensor

from megagrpo.parallel.batch import Batch, MicroBatch, PackedRows
from megagrpo.parallel.positions import RotaryPositions


def padded_width(width: int, cp: int) -> int:
    """`width` rounded up to a multiple of 2 x cp (the chunk grid)."""
    return -(-width // (2 * cp)) * (2 * cp)


def chunk_columns(width: int, cp: int, rank: int, device: torch.device | None = None) -> Tensor:
    """[2 * width / (2 cp)] int64 on `device`: the global columns (positions) CP rank `rank`
    holds of a row of padded width `width`: chunk `rank`, then chunk 2cp-1-rank."""
    c = width // (2 * cp)
    if c * 2 * cp != width:
        raise ValueError(f"width {width} is not a multiple of 2 x cp = {2 * cp}")
    return torch.cat([torch.arange(rank * c, (rank + 1) * c, device=device),
                      torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)])


@dataclass
class ChunkBatch(Batch):
    """A micro-batch's rows cut to one CP rank's columns (per-token tensors [b, 2c])."""

    seq_tokens: Tensor | None = None
    """[b] float: each row's loss tokens over all of its chunks (the whole row), for the
    sequence-mean aggregations' per-sequence denominators."""
    cp_group: object = None
    """The CP group holding the rows' other chunks (GSPO's sequence ratio sums over it)."""


def local_batch(b: Batch, columns: Tensor, width: int, group=None) -> ChunkBatch:
    """`b`'s per-token tensors [N, S, ...] right-padded (zeros / False) to `width` and cut to
    `columns` ([s]: the same for every row; [N, s]: each row's own); per-row tensors as they
    are. `group`: the CP group."""
    kw = {}
    for f in fields(Batch):
        v = getattr(b, f.name)
        if v is not None and v.dim() >= 2:
            pad = width - v.shape[1]
            if pad:
                v = torch.cat([v, v.new_zeros((v.shape[0], pad, *v.shape[2:]))], dim=1)
            v = (v.index_select(1, columns) if columns.dim() == 1 else
                 v[torch.arange(v.shape[0], device=v.device)[:, None], columns])
        kw[f.name] = v
    return ChunkBatch(**kw, seq_tokens=b.mask.sum(dim=1).to(torch.float32), cp_group=group)


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over a group (rank order); backward: the gradient summed over the
    group and this rank's rows kept (a reduce-scatter; gloo has no reduce_scatter)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group, ctx.rows = group, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        r = dist.get_rank(ctx.group)
        return grad[r * ctx.rows:(r + 1) * ctx.rows], None


def gather_sequence(x: Tensor, group) -> Tensor:
    """[s, ...] on each of the group's ranks -> [cp * s, ...] (rank-major), autograd-correct."""
    return _GatherSequence.apply(x, group)


_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _CausalChunks(torch.autograd.Function):
    """Causal attention of query chunks over their rows' keys, without a mask.

    q [b, np, s, hn], k, v [b, ng, L, hn]; `blocks`: one (q_start, k_start, c, i) per query
    chunk: queries [q_start, q_start + c) are chunk i of a row whose keys, in global order,
    start at k_start (a padded micro-batch: one row per batch entry, k_start 0; a packed one:
    the rows end to end, b = 1). Query t of chunk i sees its row's keys [0, i c) entirely (one
    unmasked block) and keys [i c, i c + t] (the diagonal block, SDPA's own causal square).
    The blocks' outputs are merged by their log-sum-exps; backward runs each block's flash
    backward with the merged output and log-sum-exp (its softmax is the whole row's, as in
    ring attention). Saved: q, k, v, the output and the log-sum-exps, all linear in the
    sequence (a mask [c, L] would be quadratic, and SDPA saves its float copy per layer)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, blocks: tuple, scale: float) -> Tensor:
        b, heads, s, hn = q.shape
        # [b, s, heads, hn] in memory, as SDPA's own output: the caller's permute to
        # [s, b, heads * hn] is then a view (b = 1), not a second copy kept by the projection
        out = q.new_empty((b, s, heads, hn)).transpose(1, 2)
        # the flash kernel's own log-sum-exp dtype: float32 for 16/32-bit inputs, float64 for
        # float64 ones (whose backward refuses a float32 one)
        lse = q.new_empty((b, heads, s), dtype=torch.promote_types(q.dtype, torch.float32))
        for q0, k0, c, i in blocks:
            rows, diag = slice(q0, q0 + c), slice(k0 + i * c, k0 + (i + 1) * c)
            o, lj = _flash(q[:, :, rows], k[:, :, diag], v[:, :, diag], 0.0, True, scale=scale)
            if i > 0:
                o0, l0 = _flash(q[:, :, rows], k[:, :, k0:k0 + i * c], v[:, :, k0:k0 + i * c],
                                0.0, False, scale=scale)
                merged = torch.logaddexp(l0, lj)
                o = ((l0 - merged).exp().unsqueeze(-1) * o0
                     + (lj - merged).exp().unsqueeze(-1) * o)
                lj = merged
            out[:, :, rows] = o
            lse[:, :, rows] = lj
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.blocks, ctx.scale = blocks, scale
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for q0, k0, c, i in ctx.blocks:
            rows = slice(q0, q0 + c)
            keys = [(slice(k0 + i * c, k0 + (i + 1) * c), True)] + (
                [(slice(k0, k0 + i * c), False)] if i > 0 else [])
            g, qj, oj, lj = (t[:, :, rows].contiguous() for t in (grad, q, out, lse))
            dq[:, :, rows] = 0
            for cols, causal in keys:
                gq, gk, gv = _flash_backward(g, qj, k[:, :, cols], v[:, :, cols], oj, lj,
                                             0.0, causal, scale=ctx.scale)
                dq[:, :, rows] += gq
                dk[:, :, cols] += gk
                dv[:, :, cols] += gv
        return dq, dk, dv, None, None


def causal_chunk_attention(q: Tensor, k: Tensor, v: Tensor, index: tuple[int, ...],
                           scale: float) -> Tensor:
    """q [b, np, n c, hn] (query chunks at the row's chunk indices `index`), k/v [b, ng, L, hn]
    (the row in global order) -> [b, np, n c, hn]: each query attends causally over the row
    (`_CausalChunks`). Exact, no mask."""
    c = q.shape[2] // len(index)
    return _CausalChunks.apply(q, k, v, tuple((j * c, 0, c, i) for j, i in enumerate(index)),
                               scale)


def cp_attention(query: Tensor, key: Tensor, value: Tensor, *, group, scale: float,
                 gqa: bool) -> Tensor:
    """Causal attention of this CP rank's queries over the whole sequence.

    query [s, b, np, hn], key/value [s, b, ng, hn]: this rank's 2 chunks (s = 2c) -> context
    [b, np, s, hn]. Keys and values are all-gathered ([cp * s, b, ng, hn], rank-major) and put
    in global order; a query at global position p attends to the keys at global positions
    <= p (`causal_chunk_attention`: no mask, whose size would grow as s^2). `gqa` (np != ng)
    needs no flag: the flash kernel broadcasts the KV groups."""
    cp, rank, s = dist.get_world_size(group), dist.get_rank(group), query.shape[0]
    order = torch.cat([chunk_columns(s * cp, cp, r, query.device) for r in range(cp)]).argsort()
    k, v = (gather_sequence(t, group).index_select(0, order) for t in (key, value))
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, k, v))          # [b, heads, s, hn]
    return causal_chunk_attention(q, k, v, (rank, 2 * cp - 1 - rank), scale)


def row_chunks(lengths: Tensor, cp: int) -> Tensor:
    """[b] row lengths -> [b] int64 chunk lengths c_i: each row padded to a multiple of
    2 x cp (at least one chunk grid) and cut into 2 x cp chunks."""
    return (-(-lengths.long() // (2 * cp))).clamp(min=1)


def row_columns(chunks: Tensor, cp: int, rank: int, fill: int) -> Tensor:
    """[b, 2 max c] int64: the columns (positions) CP rank `rank` holds of each row of chunk
    length chunks[i] (`chunk_columns` per row: chunk rank, then chunk 2cp-1-rank), `fill` after
    a row's 2 c_i."""
    c = chunks[:, None]
    j = torch.arange(2 * int(chunks.max()), device=chunks.device)[None, :]
    cols = torch.where(j < c, rank * c + j, (2 * cp - 2 - rank) * c + j)
    return torch.where(j < 2 * c, cols, fill)


def kv_order(chunks: Tensor, cp: int) -> Tensor:
    """[cp T] int64. Every CP rank's packed stream holds, row after row, its two chunks of
    each row (T = sum 2 c_i tokens, row i at offset o_i = sum_{k<i} 2 c_k); all-gathered
    rank-major they are [cp T]. Returns the gathered positions of every row's tokens in
    global order, rows end to end (row i at cp o_i): chunk j of a row is rank j's first chunk
    for j < cp, else rank 2cp-1-j's second."""
    T = 2 * int(chunks.sum())
    offset = torch.cumsum(2 * chunks, 0) - 2 * chunks
    n = 2 * cp * chunks
    row = torch.repeat_interleave(torch.arange(len(chunks), device=chunks.device), n)
    p = torch.arange(cp * T, device=chunks.device) - cp * offset[row]  # position in its row
    c = chunks[row]
    j, t = p // c, p % c
    first = j < cp
    return torch.where(first, j, 2 * cp - 1 - j) * T + offset[row] + torch.where(first, 0, c) + t


@dataclass
class ChunkRows(PackedRows):
    """A packed micro-batch (`PackedRows`) as one CP rank runs it: each row (sequence) padded
    to a multiple of 2 x cp and cut into 2 x cp chunks of c_i tokens, and this rank's chunks
    r and 2cp-1-r of every row laid end to end (T = sum 2 c_i tokens). `position_ids` are each
    token's position in its whole row (RoPE); `cp_packed_attention` reads the rest."""

    kv_order: Tensor | None = None
    """[cp T] `kv_order`: the all-gathered streams -> every row whole, rows end to end."""
    blocks: tuple = ()
    """`_CausalChunks`' (q_start, k_start, c_i, chunk) of each of this rank's chunks."""
    span: int = 0
    """The longest row padded, 2 cp max c_i (the RoPE table's rows)."""

    @classmethod
    def of_chunks(cls, ids: Tensor, columns: Tensor, chunks: Tensor, cp: int,
                  rank: int) -> "ChunkRows":
        """ids [b, 2 max c]: this rank's tokens of each row (`row_columns`: `columns`)."""
        rows = PackedRows.of(ids, 2 * chunks)
        offsets, cs = rows.cu_seqlens[:-1].tolist(), chunks.tolist()
        blocks = tuple(blk for o, c in zip(offsets, cs)
                       for blk in ((o, cp * o, c, rank), (o + c, cp * o, c, 2 * cp - 1 - rank)))
        kw = {f.name: getattr(rows, f.name) for f in fields(PackedRows)}
        kw["position_ids"] = columns.reshape(-1)[rows.unpad_index][None]
        return cls(**kw, kv_order=kv_order(chunks, cp), blocks=blocks,
                   span=2 * cp * max(cs))

    def seq_params(self):
        """`PackedRows.seq_params` with the RoPE table long enough for the longest whole row
        (which may exceed this rank's T)."""
        p = super().seq_params()
        p.max_seqlen_q = p.max_seqlen_kv = max(int(self.ids.shape[1]), self.span)
        return p


def cp_packed_attention(query: Tensor, key: Tensor, value: Tensor, rows: ChunkRows, *, group,
                        scale: float) -> Tensor:
    """Causal attention of this CP rank's chunks of packed rows, each row over its own keys.

    query [T, 1, np, hn], key/value [T, 1, ng, hn] (`ChunkRows`' stream) -> [1, np, T, hn].
    The keys and values of the whole micro-batch are all-gathered once ([cp T, 1, ng, hn]) and
    put in global order, rows end to end; each query chunk attends to its own row's keys at
    positions up to its own (`_CausalChunks` over `rows.blocks`): no key of another row, no
    mask."""
    k, v = (gather_sequence(t, group).index_select(0, rows.kv_order) for t in (key, value))
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, k, v))          # [1, heads, s, hn]
    return _CausalChunks.apply(q, k, v, rows.blocks, scale)


def context_parallel_group(gpt: torch.nn.Module):
    """The CP group `gpt` was built for (megatron's parallel_state), None at cp = 1."""
    config = getattr(gpt, "config", None)
    if config is None or getattr(config, "context_parallel_size", 1) == 1:
        return None
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_group()


def prepare_model(gpt: torch.nn.Module) -> None:
    """Under CP: megatron's RoPE module would hand each CP rank its chunks of the table in
    megatron's own order; megagrpo reads the table at its columns' positions instead
    (`ChunkSplit.rope`), so that slicing is switched off."""
    rotary = getattr(gpt, "rotary_pos_emb", None)
    if rotary is not None and hasattr(rotary, "cp_group"):
        rotary.cp_group = None


@dataclass
class ChunkSplit:
    """One micro-batch as this CP rank runs it."""

    group: object
    """The CP group."""
    width: int
    """The micro-batch's width S before padding."""
    padded: int
    """S padded to a multiple of 2 x cp (packed rows: + 1, a column of zeros that fills each
    row's `columns` after its chunks)."""
    columns: Tensor
    """This rank's global columns: [2c] of every row (padded rows), or [b, 2 max c] each row's
    own (packed rows: `row_columns`)."""
    micro: MicroBatch
    """The micro-batch with this rank's `ChunkBatch` (and packed: its `ChunkRows`)."""
    chunks: Tensor | None = None
    """[b] each packed row's chunk length c_i (None: padded rows)."""

    @classmethod
    def of(cls, gpt: torch.nn.Module, mb: MicroBatch) -> "ChunkSplit | None":
        """The split of `mb` on this rank; None without context parallelism. Padded rows are
        cut at the micro-batch's width padded to 2 x cp chunks; packed rows each at its own
        length padded so (its chunks laid end to end: `ChunkRows`)."""
        group = context_parallel_group(gpt)
        if group is None:
            return None
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        width = mb.batch.ids.shape[1]
        padded = padded_width(width, cp)
        if mb.packed is None:
            cols = chunk_columns(padded, cp, rank, mb.batch.ids.device)
            return cls(group=group, width=width, padded=padded, columns=cols,
                       micro=replace(mb, batch=local_batch(mb.batch, cols, padded, group)))
        cu = mb.packed.cu_seqlens
        chunks = row_chunks(cu[1:] - cu[:-1], cp).to(mb.batch.ids.device)
        cols = row_columns(chunks, cp, rank, padded)
        local = local_batch(mb.batch, cols, padded + 1, group)
        rows = ChunkRows.of_chunks(local.ids, cols, chunks, cp, rank)
        return cls(group=group, width=width, padded=padded + 1, columns=cols,
                   micro=replace(mb, batch=local, packed=rows), chunks=chunks)

    def rope(self, gpt: torch.nn.Module):
        """Context in which the model's RoPE rotates each local token by its global position
        (packed rows: their `position_ids` already are)."""
        hook = RotaryPositions.of(gpt)
        return nullcontext() if hook is None or self.chunks is not None else hook.at(self.columns)

    def loss(self, loss_fn: Callable) -> Callable:
        """`loss_fn(batch, output, **kw) -> (loss, report)` with the report made whole."""
        return _ReportedLoss(self, loss_fn)

    def report(self, rep: dict) -> dict:
        """This rank's loss report -> the row's: 'logp' [b, 2c] all-gathered to [b, S]; every
        scalar summed over the CP group (one all-reduce)."""
        out = dict(rep)
        if "logp" in rep:
            out["logp"] = self._gather_columns(rep["logp"].detach())
        keys = [k for k, v in rep.items() if k != "logp" and torch.is_tensor(v) and v.dim() == 0]
        if keys:
            vec = torch.stack([rep[k].detach().to(torch.float64) for k in keys])
            dist.all_reduce(vec, group=self.group)
            out.update({k: x.to(rep[k].dtype) for k, x in zip(keys, vec)})
        return out

    def _gather_columns(self, local: Tensor) -> Tensor:
        """[b, 2c] on each CP rank -> [b, S] in global column order."""
        cp = dist.get_world_size(self.group)
        parts = [torch.empty_like(local) for _ in range(cp)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        full = local.new_zeros((local.shape[0], self.padded))
        for r, part in enumerate(parts):
            cols = (chunk_columns(self.padded, cp, r, local.device) if self.chunks is None
                    else row_columns(self.chunks, cp, r, self.padded - 1))
            full.scatter_(1, cols.expand_as(part), part)  # packed: padding slots -> the fill
        return full[:, :self.width]


@dataclass
class _ReportedLoss:
    """A loss function whose report `ChunkSplit.report` makes whole (a class, not a closure:
    megatron calls it after the forward)."""

    split: ChunkSplit
    loss_fn: Callable

    def __call__(self, *args, **kwargs):
        loss, rep = self.loss_fn(*args, **kwargs)
        return loss, self.split.report(rep)
