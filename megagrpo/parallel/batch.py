"""Rollout completions -> padded training tensors and micro-batches.

Layout: N sequences (prompt + completion) right-padded to S tokens, `ids` [N, S]. Position t's
logits predict token t+1, so every per-token tensor is [N, S] aligned with the logits: `target`
[N, S] = ids shifted left (last column unused), `mask` [N, S] True where the target is a
completion token. Keeping S columns (not S-1) lets the logits [b, S, V_local] flatten to
[b*S, V_local] as a view, with no copy of the biggest tensor in the step.

Vision-language rows (Qwen2.5-VL, docs/vlm.md) carry two more fields: `positions` [N, S, 3]
(the multimodal RoPE positions, per token, so every row operation cuts them as it cuts `ids`)
and `images` (`RowImages`: each row's patches and grids, which differ in size from row to row,
so they are kept per row and concatenated in row order for each micro-batch's forward).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from megagrpo.config.model import ModelConfig
from megagrpo.parallel.mrope import image_positions, rope_index


@dataclass
class RowImages:
    """Each row's images as transformers' image processor gives them: `pixel_values[i]`
    [P_i, C*t*p*p] (the row's patches, its images in prompt order; P_i = 0 for a row with
    none) and `grid_thw[i]` [n_i, 3] (patches along time, height, width of each image)."""

    pixel_values: list[Tensor]
    grid_thw: list[Tensor]

    def __len__(self) -> int:
        return len(self.grid_thw)

    def __getitem__(self, index) -> "RowImages":
        """Rows `index` (a slice or an [b] index tensor), as Batch.rows / select take them."""
        if isinstance(index, slice):
            return RowImages(self.pixel_values[index], self.grid_thw[index])
        rows = [int(i) for i in index.reshape(-1)]
        return RowImages([self.pixel_values[i] for i in rows], [self.grid_thw[i] for i in rows])

    def to(self, device, non_blocking: bool = False) -> "RowImages":
        return RowImages([p.to(device, non_blocking=non_blocking) for p in self.pixel_values],
                         [g.to(device, non_blocking=non_blocking) for g in self.grid_thw])

    def model_inputs(self) -> dict[str, Tensor | None]:
        """The rows' images concatenated in row order: the model's `pixel_values` [P, D] and
        `image_grid_thw` [n, 3] keywords (None when no row holds an image)."""
        grids = [g for g in self.grid_thw if g.shape[0]]
        if not grids:
            return {"pixel_values": None, "image_grid_thw": None}
        return {"pixel_values": torch.cat([p for p in self.pixel_values if p.shape[0]]),
                "image_grid_thw": torch.cat(grids)}


@dataclass
class Batch:
    """One DP replica's training data for a step (identical on its TP/PP ranks)."""

    ids: Tensor
    """[N, S] int64 prompt + completion tokens, right-padded."""
    target: Tensor
    """[N, S] int64 next-token targets (ids shifted left)."""
    mask: Tensor
    """[N, S] bool: the target is a completion token that counts in the loss."""
    advantages: Tensor
    """[N, S] fp32 per-token advantages (the sequence's value on its tokens)."""
    rollout_logp: Tensor
    """[N, S] fp32 vLLM's sampling log-probs of the targets (0 off-mask)."""
    seq_valid: Tensor
    """[N] bool: a real sequence (False for padding rows added to fill micro-batches)."""
    old_logp: Tensor | None = None
    """[N, S] fp32 trainer log-probs before the update (last stage; None = on-policy)."""
    ref_logp: Tensor | None = None
    """[N, S] fp32 reference log-probs (last stage; None without a reference)."""
    is_weight: Tensor | None = None
    """[N, S] fp32 rollout importance weights (None = off)."""
    rewards: Tensor | None = None
    """[N] fp32 shaped reward of each row's sequence (0 on padding rows; None = not kept)."""
    lengths: Tensor | None = None
    """[N] int64 prompt + completion tokens of each row (0 on padding rows; None = S)."""
    lags: Tensor | None = None
    """[N] int64 optimizer updates between each row's sampling policy and the trainer (0 on
    padding rows; set by `Trainer.prepare` so that token balancing moves them with the rows)."""
    routes: Tensor | None = None
    """[N, S, L_moe, k] int16 the experts vLLM routed each position to (-1: vLLM computed none,
    -2: none needed, i.e. padding and each row's last token; routing replay only, else None)."""
    positions: Tensor | None = None
    """[N, S, 3] int64 multimodal RoPE positions (temporal, height, width) of every token of a
    vision-language model's rows (None: a text model's 1-D positions 0..S-1)."""
    images: RowImages | None = None
    """Each row's images (vision-language rows; None: none)."""
    image_mask: Tensor | None = None
    """[N, S] bool: the prompt's image pads, whose embeddings are the image features (a pad
    token sampled in a completion is text; vision-language rows only, else None)."""

    @property
    def num_seqs(self) -> int:
        return self.ids.shape[0]

    def rows(self, lo: int, hi: int) -> "Batch":
        """Rows [lo, hi) of every tensor (views)."""
        kw = {f.name: (getattr(self, f.name)[lo:hi] if getattr(self, f.name) is not None
                       else None) for f in fields(self)}
        return Batch(**kw)

    def micro_batches(self, size: int) -> list["Batch"]:
        return [self.rows(i, i + size) for i in range(0, self.num_seqs, size)]

    def select(self, index: Tensor, width: int) -> "Batch":
        """Rows `index` [b] of every tensor, per-token tensors cut to their first `width`
        columns (copies)."""
        kw = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v is not None:
                v = v[index]
                per_token = isinstance(v, Tensor) and v.dim() >= 2  # [N, S, ...]
                kw[f.name] = v[:, :width] if per_token else v
            else:
                kw[f.name] = None
        return Batch(**kw)

    def real(self, values: Tensor) -> Tensor:
        """Per-row values [N] -> the real sequences' [n], in sequence (completion) order."""
        return values[self.seq_valid]

    def set_advantages(self, seq_advantages: Tensor) -> None:
        """Writes one advantage per real sequence ([n], sequence order) onto its loss tokens."""
        row = torch.zeros(self.num_seqs, dtype=torch.float32)
        row[self.seq_valid] = seq_advantages.to(torch.float32)
        self.advantages = torch.where(self.mask, row[:, None], 0.0)


@dataclass
class PackedRows:
    """A micro-batch's b rows laid end to end as one sequence of T = sum(lengths) tokens (what
    megatron calls the `thd` layout): no padding reaches the dense layers; attention keeps each
    row to itself (`megagrpo.parallel.attention`) and positions restart at 0 on every row."""

    ids: Tensor
    """[1, T] int64 the rows' real tokens, row after row."""
    position_ids: Tensor
    """[1, T] int64 position of each token within its own row."""
    cu_seqlens: Tensor
    """[b + 1] int32 start of each row in T (and T)."""
    max_len: int
    """The longest row."""
    unpad_index: Tensor
    """[T] int64: each token's place in the row-major [b, max_len] grid of the rows
    (row i's token t at i * max_len + t)."""

    @property
    def grid(self) -> tuple[int, int]:
        """(rows b, max_len): the padded grid attention runs on."""
        return int(self.cu_seqlens.numel()) - 1, self.max_len

    @classmethod
    def of(cls, ids: Tensor, lengths: Tensor) -> "PackedRows":
        """Packs rows `ids` [b, W] whose first `lengths` [b] (each >= 1) tokens are real."""
        b = ids.shape[0]
        cu = torch.zeros(b + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lengths, 0)
        L = int(lengths.max())
        col = torch.arange(L)
        real = col[None, :] < lengths[:, None]                          # [b, L]
        return cls(ids=ids[:, :L][real][None], position_ids=col.expand(b, L)[real][None],
                   cu_seqlens=cu, max_len=L, unpad_index=real.reshape(-1).nonzero().squeeze(1))

    def positions(self, flat: Tensor, width: int) -> Tensor:
        """Flat indices into the unpacked rows [b, width] (within each row's length) -> the
        same tokens' indices into T, in the same order."""
        return self.cu_seqlens[:-1].long()[flat // width] + flat % width

    def seq_params(self):
        """megatron-core's PackedSeqParams carrying this packing to `megagrpo.parallel.attention`.

        Format 'sbhd', not 'thd': megatron then keeps its ordinary layout and RoPE (each token's
        position comes from `megagrpo.parallel.positions.RotaryPositions`), and hands the parameters
        to the core attention, which keeps each row to itself. max_seqlen = T makes GPTModel build
        its RoPE table for T positions, enough for every row."""
        from megatron.core.packed_seq_params import PackedSeqParams

        T = int(self.ids.shape[1])
        p = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=self.cu_seqlens,
                            cu_seqlens_kv=self.cu_seqlens, max_seqlen_q=T, max_seqlen_kv=T)
        p.megagrpo_rows = self  # read by megagrpo.parallel.attention.SdpaAttention
        return p


@dataclass
class MicroBatch:
    """One micro-batch of a (mini)batch: which of its rows, and their data."""

    index: Tensor
    """[b] int64 rows of the parent batch."""
    batch: Batch
    """Those rows, per-token tensors [b, width]."""
    packed: PackedRows | None = None
    """The same rows packed end to end (what the model runs on); None: `batch.ids` as is."""


def plan_micro_batches(batch: Batch, size: int, *, token_budget: int = 0,
                       trim: bool = True, packed: bool = False) -> list[MicroBatch]:
    """Cuts `batch` into micro-batches that waste little compute on padding.

    trim=False: consecutive rows, `size` per micro-batch, full width S (the fixed shapes
    pipeline parallelism's point-to-point transfers need). trim=True: rows sorted by length
    (longest first), each micro-batch cut to its longest row; `size` rows each, and with
    `token_budget` > 0 at most as many as keep rows x width <= token_budget (at least one). Causal
    attention makes a row's logits independent of the padding after it, so trimming changes
    no result beyond float summation order.

    packed=True (needs token_budget > 0): rows sorted by length (longest first) go into a
    micro-batch while their summed lengths fit token_budget (at least one row; `size` does not
    cap them), each micro-batch carrying its rows end to end (`PackedRows`): the dense layers
    see no padding at all."""
    n, S = batch.ids.shape
    if packed:
        return _plan_packed(batch, token_budget)
    if not trim:
        return [MicroBatch(torch.arange(i, min(i + size, n)), batch.rows(i, i + size))
                for i in range(0, n, size)]
    lengths = batch.lengths if batch.lengths is not None else torch.full((n,), S)
    order = torch.sort(lengths, descending=True, stable=True).indices
    groups, start = [], 0
    while start < n:
        width = max(int(lengths[order[start]]), 1)  # the longest row of this group
        rows = min(size, max(1, token_budget // width)) if token_budget > 0 else size
        groups.append(order[start:start + rows])
        start += rows
    return [MicroBatch(idx, batch.select(idx, max(int(lengths[idx].max()), 1)))
            for idx in groups]


def _plan_packed(batch: Batch, token_budget: int) -> list[MicroBatch]:
    if token_budget <= 0:
        raise ValueError(f"packed micro-batches need a token budget > 0 (got {token_budget})")
    n, S = batch.ids.shape
    lengths = (batch.lengths if batch.lengths is not None else torch.full((n,), S)).clamp(min=1)
    order = torch.sort(lengths, descending=True, stable=True).indices
    plan, start, ls = [], 0, lengths[order].tolist()
    while start < n:
        end, total = start + 1, ls[start]
        while end < n and total + ls[end] <= token_budget:
            total += ls[end]
            end += 1
        idx = order[start:end]
        sub = batch.select(idx, ls[start])
        plan.append(MicroBatch(idx, sub, PackedRows.of(sub.ids, lengths[idx])))
        start = end
    return plan


def to_device(mb: MicroBatch, device: torch.device) -> MicroBatch:
    """`mb` with its batch's and packing's tensors on `device` (the model's), for the forward
    and the loss; `mb` itself when they are there already (on CPU: always). `index` stays
    where the plan made it (it addresses the parent batch, on the host). The host tensors are
    ordinary (pageable) memory, so `non_blocking` only lets the copies queue."""
    if mb.batch.ids.device == device:
        return mb

    def move(obj):
        if obj is None:
            return None
        kw = {f.name: getattr(obj, f.name) for f in fields(obj)}
        return replace(obj, **{k: v.to(device, non_blocking=True) for k, v in kw.items()
                               if isinstance(v, (Tensor, RowImages))})

    return MicroBatch(mb.index, move(mb.batch), move(mb.packed))


def unplan(parts: list[Tensor], plan: list[MicroBatch], shape: tuple[int, int]) -> Tensor:
    """Per-micro-batch [b, width] tensors -> one [N, S] tensor in the parent's row order
    (zeros beyond each row's width), on the parts' device."""
    device = parts[0].device if parts else None
    out = torch.zeros(shape, dtype=parts[0].dtype if parts else torch.float32, device=device)
    for part, mb in zip(parts, plan):
        out[mb.index.to(device), :part.shape[1]] = part
    return out


def spread_rows(n: int, rows: int, blocks: int) -> Tensor:
    """Row index [n] of each of n sequences in `rows` rows cut into `blocks` equal blocks: the
    sequences are spread over the blocks as evenly as possible, in order, each block's padding
    at its end. So no block (minibatch) is all padding while n >= blocks."""
    if rows % blocks or n > rows:
        raise ValueError(f"{n} sequences do not fit {rows} rows in {blocks} equal blocks")
    per, (base, extra) = rows // blocks, divmod(n, blocks)
    return torch.tensor([b * per + j for b in range(blocks) for j in range(base + (b < extra))],
                        dtype=torch.long)


def pack(prompts: list[list[int]], completions: Sequence[Sequence[int]],
         rollout_logps: Sequence[Sequence[float]],
         seq_advantages: Tensor, *, pad_id: int, multiple: int = 1, blocks: int = 1,
         completion_mask: Tensor | None = None, seq_rewards: Tensor | None = None,
         routes: list[Tensor] | None = None,
         loss_masks: Sequence[Sequence[bool] | None] | None = None,
         images: list[tuple[Tensor, Tensor] | None] | None = None,
         vlm: ModelConfig | None = None) -> Batch:
    """Builds a `Batch` from n = len(completions) sequences (prompts[i] belongs to sequence i).
    A sequence's completion, log-probs and loss mask are lists or 1-D tensors.

    `multiple`: the rows are padded with dummy rows (mask False) to a multiple of it, so every
    micro-batch has the same shape (pipeline parallelism needs that). `blocks` (dividing
    `multiple`): the rows are `blocks` equal minibatches and the padding is spread over them
    (`spread_rows`), so a minibatch never holds only padding while n >= blocks; real rows keep
    their order. `completion_mask` [n] False drops a sequence from the loss (e.g. truncated
    completions). `seq_rewards` [n] are kept per row in `Batch.rewards`, `routes` (n tensors
    [len(prompt) + len(completion), L_moe, k]) in `Batch.routes` (-1 on padding).
    `loss_masks` (n lists, one bool per completion token, or None = all True): multi-turn
    trajectories, False on the environment's tokens, which then carry no loss, KL or vLLM-gap
    weight (every later stage reads `Batch.mask`); their `rollout_logps` entries must be 0."""
    n = len(completions)
    S = max(len(p) + len(c) for p, c in zip(prompts, completions))
    rows = -(-n // multiple) * multiple
    if multiple % blocks:
        raise ValueError(f"pack: blocks={blocks} must divide multiple={multiple}")
    where = spread_rows(n, rows, blocks)
    ids = torch.full((rows, S), pad_id, dtype=torch.long)
    mask = torch.zeros(rows, S, dtype=torch.bool)
    rlogp = torch.zeros(rows, S, dtype=torch.float32)
    for i, (p, c, lp) in enumerate(zip(prompts, completions, rollout_logps)):
        L, r = len(p), int(where[i])  # r: the row of sequence i
        ids[r, :L] = torch.as_tensor(p, dtype=torch.long)
        if len(c):  # as_tensor: a list, or a row of `SampleColumns` (a view, no list made)
            ids[r, L:L + len(c)] = torch.as_tensor(c, dtype=torch.long)
            keep = completion_mask is None or bool(completion_mask[i])
            mask[r, L - 1:L - 1 + len(c)] = keep
            if keep and loss_masks is not None and loss_masks[i] is not None:
                mask[r, L - 1:L - 1 + len(c)] = torch.as_tensor(loss_masks[i], dtype=torch.bool)
            rlogp[r, L - 1:L - 1 + len(lp)] = torch.as_tensor(lp, dtype=torch.float32)
    target = torch.roll(ids, -1, dims=1)
    target[:, -1] = pad_id
    valid = torch.zeros(rows, dtype=torch.bool)
    valid[where] = True
    lengths = torch.zeros(rows, dtype=torch.long)
    lengths[where] = torch.tensor([len(p) + len(c) for p, c in zip(prompts, completions)],
                                  dtype=torch.long)
    batch = Batch(ids=ids, target=target, mask=mask, advantages=torch.zeros(rows, S),
                  rollout_logp=rlogp, seq_valid=valid, lengths=lengths)
    batch.set_advantages(seq_advantages)
    if seq_rewards is not None:
        batch.rewards = torch.zeros(rows, dtype=torch.float32)
        batch.rewards[where] = seq_rewards.to(torch.float32)
    if vlm is not None:
        _add_images(batch, where, images or [None] * n, vlm, [len(p) for p in prompts])
    if routes is not None:  # padding: -2, "no route needed", like the last tokens
        batch.routes = torch.full((rows, S, *routes[0].shape[1:]), -2, dtype=torch.int16)
        for i, r in enumerate(routes):
            batch.routes[int(where[i]), : r.shape[0]] = r
    return batch


def _add_images(batch: Batch, where: Tensor, images: list, vlm: ModelConfig,
                prompt_lens: list[int]) -> None:
    """`Batch.positions`, `Batch.images` and `Batch.image_mask` of the packed rows (`where[i]`:
    sequence i's row; `prompt_lens[i]`: its prompt's tokens, the only ones that may be
    images)."""
    rows, S = batch.ids.shape
    v = vlm.vision
    width = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
    pixels = [torch.zeros(0, width) for _ in range(rows)]
    grids = [torch.zeros(0, 3, dtype=torch.long) for _ in range(rows)]
    pos = torch.arange(S).expand(rows, 3, S).clone()
    image_mask = torch.zeros(rows, S, dtype=torch.bool)
    for i, r in enumerate(where.tolist()):
        grid = None
        if images[i] is not None:
            pix, grid = images[i]
            if pix.shape[1] != width or int(grid.prod(-1).sum()) != pix.shape[0]:
                raise ValueError(f"sequence {i}: pixel_values {list(pix.shape)} do not fit "
                                 f"image_grid_thw {grid.tolist()} (each row one patch of "
                                 f"{width} values, one per grid cell)")
            pixels[r], grids[r] = pix, grid.to(torch.long)
        n = int(batch.lengths[r])
        p, _ = rope_index(batch.ids[r, :n], grid, vlm, prompt_lens[i])
        image_mask[r, :n] = image_positions(batch.ids[r, :n], vlm.image_token_id, prompt_lens[i])
        pos[r, :, :n] = p
        if n < S:  # padding: text after the row's last position
            pos[r, :, n:] = int(p.max()) + 1 + torch.arange(S - n)
    batch.positions = pos.transpose(1, 2).contiguous()
    batch.images = RowImages(pixels, grids)
    batch.image_mask = image_mask


def sft_batch(prompts: list[list[int]], completions: list[list[int]], *, pad_id: int,
              multiple: int = 1, loss_masks: list[list[bool] | None] | None = None,
              images: list[tuple[Tensor, Tensor] | None] | None = None,
              vlm: ModelConfig | None = None) -> Batch:
    """A supervised batch (cold start): same layout, advantages 1, no rollout log-probs.
    `loss_masks`, `images` and `vlm` as in `pack`."""
    zeros = [[0.0] * len(c) for c in completions]
    return pack(prompts, completions, zeros, torch.ones(len(completions)), pad_id=pad_id,
                multiple=multiple, loss_masks=loss_masks, images=images, vlm=vlm)
