"""The forward/backward drivers of a step: micro-batch plans, megatron's schedule over them, the
forward-only scoring pass and the loss normalisers. `Passes` holds what every pass needs (the
config, this rank's place and groups); the trainer, the cold start, tests and benchmarks call
it. Its `forward` is megatron's forward_step (`forward_step` below): a benchmark may wrap it to
observe each micro-batch."""
from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist

from megagrpo import algo
from megagrpo.config.train import TrainConfig
from megagrpo.model.gpt import unwrap
from megagrpo.model.moe import replay, replay_state
from megagrpo.model.optim import forward_backward
from megagrpo.parallel.batch import Batch, MicroBatch, plan_micro_batches, to_device, unplan
from megagrpo.parallel.context_parallel import ChunkSplit
from megagrpo.parallel.positions import OutputPositions, RotaryPositions, loss_positions
from megagrpo.parallel.seqpar import packed_inputs, padded_inputs, sp_size
from megagrpo.runtime import cpu_compat
from megagrpo.runtime.distributed import Groups, Ranks
from megagrpo.train.losses import LossContext, logprob_loss

DEFAULT_MICRO_BATCH_TOKENS = 1024
"""compute.micro_batch_tokens when unset (pp = 1): small enough that length-sorted micro-batches
of varied lengths waste little on padding, large enough for efficient matrix multiplies."""


def forward_step(mb: MicroBatch, model, *, loss_fn, at_loss_positions: bool = True,
                 fused_output: bool | str = False):
    """megatron forward_step: logits on the last stage, hidden states elsewhere. With
    `at_loss_positions` the last stage's output layer runs only where mb's mask is set
    (`megagrpo.parallel.positions`), and the loss function is told which positions those are. With
    `fused_output` (compute.fused_output_layer) the last stage returns the hidden states
    [n, h] at those positions instead of logits, and the loss gets the output weight
    (`weight=`) to run the fused output layer on them."""
    gpt = unwrap(model)
    # the plan lives on the host; the model's device gets each micro-batch as it runs
    mb = to_device(mb, model_device(gpt))
    b = mb.batch
    state = replay_state(gpt)
    if b.routes is not None and state is not None:  # MoE routing replay: vLLM's experts
        with replay(gpt, _router_rows(mb, gpt), state.monitor):
            return _forward(mb, model, gpt, loss_fn, at_loss_positions, fused_output)
    return _forward(mb, model, gpt, loss_fn, at_loss_positions, fused_output)


def model_device(gpt: torch.nn.Module) -> torch.device:
    """The device of `gpt`'s parameters (where its micro-batches and losses run)."""
    return next(gpt.parameters()).device


def _router_rows(mb: MicroBatch, gpt) -> torch.Tensor:
    """The micro-batch's routes [rows, L_moe, k] in the order megatron's routers see its
    tokens: the packed tokens in order, else [S, B] flattened (sequence-major)."""
    routes = mb.batch.routes
    if mb.packed is not None:
        b, width = mb.packed.grid
        return routes[:, :width].reshape(b * width, *routes.shape[2:])[mb.packed.unpad_index]
    if sp_size(gpt) > 1:  # TrainConfig.validate refuses routing replay under SP
        raise ValueError("routing replay is not supported with parallel.sequence_parallel")
    return routes.transpose(0, 1).reshape(-1, *routes.shape[2:])


def _forward(mb: MicroBatch, model, gpt, loss_fn, at_loss_positions, fused_output):
    split = ChunkSplit.of(gpt, mb)
    if split is None:
        return _forward_rows(mb, model, gpt, loss_fn, at_loss_positions, fused_output)
    # context parallelism: this rank's chunks of the rows, RoPE at their global positions
    with split.rope(gpt):
        return _forward_rows(split.micro, model, gpt, split.loss(loss_fn), at_loss_positions,
                             fused_output)


def _forward_rows(mb: MicroBatch, model, gpt, loss_fn, at_loss_positions, fused_output):
    b = mb.batch
    sp = sp_size(gpt)
    hooked = mb.packed is not None or at_loss_positions or fused_output is not False or sp > 1
    sel = OutputPositions.of(gpt) if hooked else None
    flat = (loss_positions(b.mask) if mb.packed is not None
            or (sel is not None and at_loss_positions) else None)
    fused = sel is not None and sel.use_fused(
        fused_output, b.ids.numel() if flat is None else flat.numel())
    if mb.packed is not None:  # rows end to end, loss positions only
        if b.positions is not None:
            raise ValueError("compute.pack_sequences with a vision-language model: its 3-D "
                             "positions are per row; set compute.pack_sequences=false")
        p = mb.packed
        rope = RotaryPositions.of(gpt)
        # sequence parallelism: T padded to a multiple of tp with tokens of no row
        ids, pos, pad = packed_inputs(p.ids, p.position_ids, sp)
        with (sel.at(p.positions(flat, b.ids.shape[1]), p.ids.shape[1], fused),
              rope.at(pos[0]) if rope is not None else nullcontext()):
            out = model(ids, pos, None, packed_seq_params=p.seq_params(), **pad)
        return _last_stage_output(out, sel, fused, partial(loss_fn, b, positions=flat))
    # sequence parallelism: ids padded to a multiple of tp; the output layer's hook drops
    # the padding again, so it runs whenever this stage has the output layer
    ids, pos = padded_inputs(b.ids, sp)
    extra = {}
    if b.positions is not None:  # a vision-language model: 3-D positions and the images
        pos, extra = vlm_inputs(b, sp)
    if sel is None or not (at_loss_positions or fused or ids is not b.ids):
        return model(ids, pos, None, **extra), partial(loss_fn, b)
    if flat is None and not fused:  # every position, through the hook (padding dropped)
        flat = torch.arange(b.ids.numel(), device=b.ids.device)
    with sel.at(flat, b.ids.shape[1], fused):
        out = model(ids, pos, None, **extra)
    return _last_stage_output(out, sel, fused, partial(loss_fn, b, positions=flat))


def vlm_inputs(b: Batch, sp: int) -> tuple[torch.Tensor, dict]:
    """A vision-language micro-batch's [3, b, S] positions and the model's image keywords
    (`pixel_values`, `image_grid_thw`: the rows' images in row order). TrainConfig.validate
    refuses what this path does not run (packing, sequence parallelism); refused here too."""
    if sp > 1:
        raise ValueError("parallel.sequence_parallel with a vision-language model: set "
                         "parallel.sequence_parallel=false")
    return b.positions.permute(2, 0, 1), dict(b.images.model_inputs(), image_mask=b.image_mask)


def _last_stage_output(out, sel: OutputPositions, fused: bool, loss_fn: Callable):
    """(output, loss function) of the last stage: the logits, or with the fused output layer
    the selected hidden states and a loss function that holds the output weight."""
    if not fused:
        return out, loss_fn
    hidden, weight = sel.take_hidden()
    return hidden, partial(loss_fn, weight=weight)


def row_index(keep: torch.Tensor) -> torch.Tensor:
    """[N] bool -> the kept rows' indices; row 0 when none is kept, so every rank still runs
    megatron's schedule (and its collectives)."""
    idx = keep.nonzero().squeeze(1)
    return idx if idx.numel() else torch.zeros(1, dtype=torch.long)


@dataclass
class Passes:
    """Forward/backward passes over a batch's micro-batches on this rank."""

    cfg: TrainConfig
    ranks: Ranks = field(default_factory=Ranks)
    groups: Groups = field(default_factory=Groups)
    packed: bool = False
    """Micro-batches run packed end to end (`megagrpo.parallel.batch.PackedRows`)."""
    forward: Callable = forward_step
    """megatron's forward_step for every pass (wrap it to observe micro-batches)."""

    def micro_size(self, num_seqs: int) -> int:
        """Sequences per micro-batch: compute.micro_batch_size, or a whole minibatch if
        smaller (padding rows would only cost compute)."""
        per_mini = -(-num_seqs // self.cfg.algo.num_minibatches)
        return max(1, min(self.cfg.compute.micro_batch_size, per_mini))

    def plan(self, batch: Batch, m: int) -> list[MicroBatch]:
        """Micro-batches of `batch`: length-sorted and trimmed at pp = 1 (compute.*)."""
        c = self.cfg.compute
        budget = c.micro_batch_tokens
        if budget is None:  # automatic: pipeline stages exchange fixed shapes
            budget = DEFAULT_MICRO_BATCH_TOKENS if self.ranks.pp == 1 else 0
        return plan_micro_batches(batch, m, token_budget=budget,
                                  trim=c.trim_micro_batches and self.ranks.pp == 1,
                                  packed=self.packed)

    def run(self, model, loss_fn, plan: list[MicroBatch], seq_length: int, m: int,
            forward_only: bool = False) -> list:
        """megatron's schedule over the planned micro-batches; the last stage's reports."""
        c = self.cfg.compute
        # the schedule runs inside the CPU shim's scope; the loss and its kernels do not need it
        fwd = partial(self.forward, loss_fn=partial(cpu_compat.unscoped, loss_fn),
                      at_loss_positions=c.logits_at_loss_positions,
                      fused_output=c.fused_output_layer)
        return forward_backward(model, fwd, plan, len(plan), seq_length=seq_length,
                                micro_batch_size=m, forward_only=forward_only)

    def loss_context(self, **kw) -> LossContext:
        return LossContext(tp_group=self.groups.tp, valid_local_vocab=self.ranks.valid_local_vocab,
                           temperature=self.cfg.rollout.temperature,
                           impl=self.cfg.compute.kernel_impl, **kw)

    def logprobs(self, model, batch: Batch, rows: torch.Tensor | None = None
                 ) -> torch.Tensor | None:
        """Forward-only pass through the fused log-prob kernel; [N, S] on the last stage (None
        elsewhere), on the batch's device (the host: one copy back at the end). `rows` [N]
        bool: score only those (0 elsewhere; at least one row runs)."""
        sub, idx = batch, None
        if rows is not None:
            idx = row_index(rows)
            sub = batch.select(idx, batch.ids.shape[1])
        m = self.micro_size(batch.num_seqs)
        plan = self.plan(sub, m)
        out = self.run(model, partial(logprob_loss, self.loss_context()), plan, sub.ids.shape[1],
                       m, forward_only=True)
        if not out:
            return None
        logp = unplan([o["logp"] for o in out], plan, tuple(sub.ids.shape))
        if idx is not None:
            full = torch.zeros(tuple(batch.ids.shape), dtype=logp.dtype, device=logp.device)
            full[idx.to(logp.device)] = logp
            logp = full
        return logp.to(batch.ids.device)

    def counts(self, mb: Batch, num_chunks: int) -> algo.LossCounts:
        """Global normalisers; `num_chunks` is this replica's micro-batch count (replicas may
        differ under compute.micro_batch_tokens), summed over DP. Every real sequence counts,
        with or without loss tokens (`LossCounts.num_seqs`)."""
        seqs = mb.seq_valid.sum()
        local = torch.tensor([float(mb.mask.sum()), float(seqs), float(num_chunks)],
                             dtype=torch.float64)
        dist.all_reduce(local, group=self.groups.dp)
        return algo.LossCounts(num_tokens=float(local[0]), num_seqs=float(local[1]),
                               max_len=float(self.cfg.dr_grpo_len),
                               num_chunks=int(local[2]))

    def gradient_rows(self, batch: Batch, loss_has_kl: bool) -> torch.Tensor | None:
        """[N] bool: the rows whose loss has a gradient; None: all of them (or the lever is
        off). With no KL term in the loss, a sequence whose advantage is 0 (a group whose
        rewards are all equal) adds exactly 0 to loss and gradient for every loss_agg but bnpo
        (whose chunk means depend on the rows), so its forward and backward are skipped and
        its old log-probs are not scored (compute.skip_zero_advantage); the normalisers still
        count it (`counts` reads the whole minibatch). pp = 1 only: pipeline stages exchange
        fixed shapes, and under KL-in-reward only the last stage holds the advantages."""
        if (not self.cfg.compute.skip_zero_advantage or loss_has_kl
                or self.cfg.algo.loss_agg == "bnpo" or self.ranks.pp > 1):
            return None
        keep = (batch.advantages != 0).any(dim=1) & batch.mask.any(dim=1)
        return None if bool(keep.all()) else keep

    def trained_rows(self, mini: Batch, loss_has_kl: bool) -> Batch:
        """`mini` without the rows `gradient_rows` leaves out; one row is kept so every rank
        runs the schedule (its DP all-reduce)."""
        keep = self.gradient_rows(mini, loss_has_kl)
        return mini if keep is None else mini.select(row_index(keep), mini.ids.shape[1])

    def has_loss_tokens(self, mini: Batch) -> bool:
        """Whether any replica's minibatch holds a loss token; the same answer on every rank.
        The last stage's mask decides (rollout-IS masking changes it there only)."""
        n = torch.tensor([float(mini.mask.sum()) if self.ranks.reports else 0.0],
                         dtype=torch.float64)
        dist.all_reduce(n, group=self.groups.world)
        return bool(n.item() > 0)
