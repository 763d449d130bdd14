"""Iterative GRPO (DeepSeekMath, arXiv 2402.03300, Algorithm 1) on megatron-core TP/PP models.

One step reads top to bottom:
  rollout -> reward -> advantage -> score (old / reference log-probs) -> update (mu passes x
  minibatches) -> weight sync to vLLM -> reference schedule -> log -> checkpoint.
With algo.kl_in_reward the advantages wait for the scoring pass (r - beta * KL needs the old and
reference log-probs). Nothing wrong is trained on silently: minibatches without a loss token are
skipped, and so is the update of a step with non-finite / absurd rewards or a non-finite
gradient norm; run.max_bad_steps such steps in a row raise `BadStepsError`.

Rollouts are data-parallel over *all* ranks: the in-process vLLM engines (one per rank, or one
per k = rollout.tensor_parallel_size consecutive ranks; `megagrpo.config.layout`) each sample a
slice of their DP replica's prompts and the replica's TP x PP ranks all-gather the results, so
every core samples and every rank of a replica trains on the same batch. Departures from the paper:
process supervision is not implemented (outcome rewards only); the reference can be mixed
(alpha < 1) as well as reset; async mode trains one step off-policy.
"""
from __future__ import annotations

import logging
import threading
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megagrpo import algo
from megagrpo.batch import Batch, MicroBatch, pack, plan_micro_batches, sft_batch, unplan
from megagrpo.config.layout import RolloutLayout
from megagrpo.config.train import TrainConfig
from megagrpo.data import encode_prompt
from megagrpo.kernels import kl_penalty
from megagrpo.losses import LossContext, grpo_loss, logprob_loss, sft_loss
from megagrpo.metrics import PhaseTimer
from megagrpo.model import sequence_packing, unwrap
from megagrpo.optim import (
    forward_backward,
    lr_at,
    optimizer_step,
    set_lr,
    zero_grad,
)
from megagrpo.positions import OutputPositions, RotaryPositions, loss_positions
from megagrpo.watchdog import Watchdog

if TYPE_CHECKING:
    from megagrpo.config.model import ModelConfig
    from megagrpo.data import PromptLoader
    from megagrpo.reference import Reference
    from megagrpo.rewards import RewardFn
    from megagrpo.rollout import RolloutEngine
    from megagrpo.tasks import Task

log = logging.getLogger("megagrpo")


@dataclass
class Rollout:
    """A replica's sampled batch (identical on its TP x PP ranks)."""

    prompts: list[list[int]]
    """[B] prompt token ids."""
    answers: list[str]
    """[B] reference answers."""
    completions: list = field(default_factory=list)
    """[B*G] `Completion`s, prompt-major."""
    rewards: torch.Tensor | None = None
    """[B*G] summed rewards."""
    version: int = 0
    """Optimizer steps the sampling policy had taken."""
    epoch: int = 0
    """Data epoch of the prompts."""
    metrics: dict = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class TrainerRanks:
    """Where this rank sits in the training layout (megatron parallel_state)."""

    rank: int = 0
    """Global rank."""
    dp: int = 1
    """Data-parallel size."""
    dp_rank: int = 0
    """This rank's DP replica."""
    tp_rank: int = 0
    """Tensor-parallel rank."""
    pp: int = 1
    """Pipeline stages."""
    pp_last_rank: int = 0
    """Global rank of this rank's last-stage peer (where the loss and log-probs live)."""
    mp_rank: int = 0
    """Rank inside the model-parallel (TP x PP) group."""
    mp_size: int = 1
    """TP x PP."""
    valid_local_vocab: int = 0
    """Unpadded vocab rows on this TP rank's logits shard."""


@dataclass(frozen=True, kw_only=True)
class TrainerGroups:
    """megatron's process groups this rank belongs to (None: no processes, e.g. unit tests)."""

    tp: object = None
    """Tensor-parallel group."""
    pp: object = None
    """Pipeline group."""
    dp: object = None
    """Data-parallel group."""
    mp: object = None
    """Model-parallel (TP x PP) group: the ranks of one replica."""


@dataclass(frozen=True, kw_only=True)
class TokenIds:
    """Special token ids of the run's tokenizer."""

    pad_id: int = 0
    """Padding."""
    eos_id: int = 0
    """End of sequence."""
    stop_ids: tuple[int, ...] = ()
    """Token ids that end a completion."""


class BadStepsError(RuntimeError):
    """run.max_bad_steps consecutive steps skipped their update for non-finite values."""

    def __init__(self, message: str, metrics: dict):
        super().__init__(message)
        self.metrics = metrics
        """The last step's metrics (not yet logged)."""


DEFAULT_MICRO_BATCH_TOKENS = 1024
"""run.micro_batch_tokens when unset (pp = 1): small enough that length-sorted micro-batches
of varied lengths waste little on padding, large enough for efficient matrix multiplies."""


def _forward(mb: MicroBatch, model, *, loss_fn, at_loss_positions: bool = True):
    """megatron forward_step: logits on the last stage, hidden states elsewhere. With
    `at_loss_positions` the last stage's output layer runs only where mb's mask is set
    (`megagrpo.positions`), and the loss function is told which positions those are."""
    b = mb.batch
    if mb.packed is not None:  # rows end to end, loss positions only
        p, flat, gpt = mb.packed, loss_positions(b.mask), unwrap(model)
        rope = RotaryPositions.of(gpt)
        with (OutputPositions.of(gpt).at(p.positions(flat, b.ids.shape[1]), p.ids.shape[1]),
              rope.at(p.position_ids[0]) if rope is not None else nullcontext()):
            out = model(p.ids, p.position_ids, None, packed_seq_params=p.seq_params())
        return out, partial(loss_fn, b, positions=flat)
    pos = torch.arange(b.ids.shape[1]).expand_as(b.ids)
    sel = OutputPositions.of(unwrap(model)) if at_loss_positions else None
    if sel is None:
        return model(b.ids, pos, None), partial(loss_fn, b)
    flat = loss_positions(b.mask)
    with sel.at(flat, b.ids.shape[1]):
        out = model(b.ids, pos, None)
    return out, partial(loss_fn, b, positions=flat)


class Trainer:
    """Holds the run's state; `setup` builds it, `step` runs one GRPO iteration."""

    def __init__(self, cfg: TrainConfig, *, model_cfg: ModelConfig | None = None,
                 policy: list | None = None, optimizer=None, reference: Reference | None = None,
                 engine: RolloutEngine | None = None, loader: PromptLoader | None = None,
                 task: Task | None = None, reward_fn: RewardFn | None = None,
                 layout: RolloutLayout | None = None, ranks: TrainerRanks | None = None,
                 groups: TrainerGroups | None = None, tokens: TokenIds | None = None,
                 total_opt_steps: int = 1):
        """`megagrpo.run.setup` builds every part; tests may leave out what they do not use."""
        self.cfg = cfg
        self.model_cfg = model_cfg
        """The architecture (from run.init's checkpoint when it has one)."""
        self.policy = policy
        """The policy's model chunks (DDP-wrapped megatron GPTModel stage)."""
        self.optimizer = optimizer
        """megatron's optimizer over the policy (replaced after the cold start)."""
        self.reference = reference
        """The reference model and its reset schedule (None when algo.beta = 0)."""
        self.engine = engine
        """This rank's vLLM engine (one of world / rollout.tensor_parallel_size)."""
        self.loader = loader
        """This DP replica's prompt stream."""
        self.task = task
        """Train/eval examples and the tokenizer."""
        self.tokenizer = task.tokenizer if task is not None else None
        self.reward_fn = reward_fn
        """The reward terms (scores completions against answers)."""
        self.layout = layout or RolloutLayout(rank=0, world_size=1, engine_tp=1, train_tp=1,
                                              train_pp=1)
        """Which ranks form this rank's vLLM engine and which prompts it samples."""
        r = ranks or TrainerRanks()
        self.rank, self.dp, self.dp_rank, self.tp_rank = r.rank, r.dp, r.dp_rank, r.tp_rank
        self.pp, self.pp_last_rank, self.mp_rank, self.mp_size = (r.pp, r.pp_last_rank,
                                                                  r.mp_rank, r.mp_size)
        self.valid_local_vocab = r.valid_local_vocab
        g = groups or TrainerGroups()
        self.tp_group, self.pp_group, self.dp_group, self.mp_group = (g.tp, g.pp, g.dp, g.mp)
        t = tokens or TokenIds()
        self.pad_id, self.eos_id, self.stop_ids = t.pad_id, t.eos_id, t.stop_ids
        self.packed = sequence_packing(cfg.run, cfg.parallel)
        """Micro-batches run packed end to end (`megagrpo.batch.PackedRows`)."""
        self.opt_steps = 0  # optimizer steps taken (the LR schedule's position)
        self.total_opt_steps = total_opt_steps
        self.step_idx = 0
        self.version = 0  # optimizer updates applied to the policy (GRPO steps)
        self.engine_version = -1  # policy version vLLM holds (-1: none yet)
        self._pending: Rollout | None = None
        self.bad_steps = 0  # consecutive steps whose update was skipped for bad values
        self._thread: threading.Thread | None = None
        self.watchdog: Watchdog | None = None  # run.train attaches the run's stall watchdog

    # ------------------------------------------------------------------ rollout
    def _prompt_batch(self) -> tuple[list[list[int]], list[str], int]:
        examples = next(self.loader)
        ids = [encode_prompt(self.tokenizer, e.prompt) for e in examples]
        return ids, [e.answer for e in examples], self.loader.epoch

    def _sample_local(self, prompts: list[list[int]], answers: list[str]) -> tuple:
        """This rank's slice of the replica's prompts: generate G completions each and score
        them. No collectives, so it may run on the async rollout thread."""
        from megagrpo.rollout import SamplingSettings

        r_cfg = self.cfg.rollout
        sampling = SamplingSettings(
            temperature=r_cfg.temperature, top_p=r_cfg.top_p, top_k=r_cfg.top_k,
            max_tokens=r_cfg.max_tokens, stop=tuple(r_cfg.stop), n=self.cfg.algo.group_size,
            stop_token_ids=self.stop_ids)
        mine = self.layout.prompt_indices(len(prompts))  # this rank's engine's slice
        comps = self.engine.generate([prompts[i] for i in mine], sampling) if mine else []
        if not self.layout.is_leader:  # the engine's TP rank 0 reports its completions
            comps = []
        texts = [c.text or self.tokenizer.decode(c.token_ids) for c in comps]
        ans = [answers[mine[c.prompt_index]] for c in comps]
        rewards, per_term, metrics = self.reward_fn.score(texts, ans) if comps else (
            torch.zeros(0), None, {})
        verdicts = self.reward_fn.correct(per_term).tolist() if comps else []
        for c, ok in zip(comps, verdicts):
            c.prompt_index, c.correct = mine[c.prompt_index], bool(ok)
        return comps, rewards.tolist(), metrics

    def _gather(self, local: tuple, num_prompts: int) -> tuple[list, torch.Tensor, dict]:
        """All-gathers the slices over the model-parallel group (pooled layout: the world, then
        keeps this replica's [num_prompts] prompts), so every rank of the replica holds the
        whole batch: completions [B*G] prompt-major, rewards [B*G], metrics."""
        pooled = self.layout.pooled
        size = dist.get_world_size() if pooled else self.mp_size
        parts = [None] * size
        if size > 1:
            dist.all_gather_object(parts, local, group=None if pooled else self.mp_group)
        else:
            parts = [local]
        lo = self.dp_rank * num_prompts if pooled else 0
        merged = sorted(((c, rw) for cs, rws, _ in parts for c, rw in zip(cs, rws)
                         if lo <= c.prompt_index < lo + num_prompts),
                        key=lambda x: (x[0].prompt_index, x[0].sample_index))
        for c, _ in merged:
            c.prompt_index -= lo
        metrics = _sum_dicts([m for _, _, m in parts])
        if pooled:  # counts over every replica's prompts: per replica on average
            metrics = {k: v / self.dp for k, v in metrics.items()}
        return [c for c, _ in merged], torch.tensor([rw for _, rw in merged]), metrics

    def _pool(self, prompts: list[list[int]], answers: list[str]) -> tuple[list, list]:
        """Pooled layout: every replica's prompts and answers, replica-major [dp * B]."""
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (self.dp_rank, prompts, answers))
        by_replica = {d: (p, a) for d, p, a in parts}
        return ([p for d in range(self.dp) for p in by_replica[d][0]],
                [a for d in range(self.dp) for a in by_replica[d][1]])

    def _draw(self) -> tuple:
        """Prompts of the next batch, sampled locally; returns what `_collect` needs."""
        version = self.engine_version  # the weights vLLM holds while it samples this batch
        prompts, answers, epoch = self._prompt_batch()
        pool = self._pool(prompts, answers) if self.layout.pooled else (prompts, answers)
        return prompts, answers, epoch, version, self._sample_local(*pool)

    def _collect(self, drawn: tuple) -> Rollout:
        prompts, answers, epoch, version, local = drawn
        comps, rewards, rm = self._gather(local, len(prompts))
        return Rollout(prompts=prompts, answers=answers, completions=comps, rewards=rewards,
                       version=version, epoch=epoch, metrics=rm)

    def rollout(self, drawn: tuple | None = None) -> Rollout:
        """Samples G completions for a batch of prompts; with dynamic sampling, tops the batch
        up with fresh prompts until it holds data.batch_size/dp groups with reward spread."""
        ro = self._collect(drawn if drawn is not None else self._draw())
        if not self.cfg.algo.dynamic_sampling:
            return ro
        return self._dynamic_sampling(ro, len(ro.prompts), self.cfg.algo.group_size)

    def _dynamic_sampling(self, ro: Rollout, want: int, G: int) -> Rollout:
        keep, _ = algo.filter_groups(ro.rewards, G)
        kept = _select_groups(ro, keep, G)
        rounds = 0
        # all ranks agree on the number of rounds so the data loaders stay in lockstep
        while _any_rank(len(kept.prompts) < want) and rounds < self.cfg.algo.max_resample_rounds:
            more = self._collect(self._draw())
            keep, _ = algo.filter_groups(more.rewards, G)
            kept = _concat(kept, _select_groups(more, keep, G))
            kept.epoch = more.epoch
            rounds += 1
        metrics = dict(ro.metrics, resample_rounds=rounds,
                       filtered_groups=want - min(len(kept.prompts), want))
        if not kept.prompts:  # nothing with signal: train on the batch (zero advantages)
            kept = ro
        kept.metrics = metrics  # same keys on every rank (they are averaged over DP)
        return _truncate(kept, want, G)

    # ------------------------------------------------------------------ advantage
    def build_batch(self, ro: Rollout) -> tuple[Batch, dict]:
        """Packs the rollout (padding spread over the minibatches) with its shaped rewards and,
        unless KL-in-reward must wait for the scoring pass, their group advantages."""
        a, n_mini = self.cfg.algo, self.cfg.run.num_minibatches
        prompts = [ro.prompts[c.prompt_index] for c in ro.completions]
        lengths = torch.tensor([len(c.token_ids) for c in ro.completions])
        truncated = torch.tensor([c.finish_reason == "length" for c in ro.completions])
        rewards = ro.rewards.float()
        if a.overlong_buffer:
            rewards = rewards + algo.overlong_penalty(lengths, self.cfg.rollout.max_tokens,
                                                      a.overlong_buffer, a.overlong_penalty)
        keep = ~truncated if a.mask_truncated else None
        mb = self.micro_size(len(ro.completions)) * n_mini
        batch = pack(prompts, [c.token_ids for c in ro.completions],
                     [c.logprobs for c in ro.completions], torch.zeros(len(rewards)),
                     pad_id=self.pad_id, multiple=mb, blocks=n_mini, completion_mask=keep,
                     seq_rewards=rewards)
        correct = torch.tensor([bool(c.correct) for c in ro.completions])
        metrics = dict(algo.reward_metrics(ro.rewards.float(), a.group_size, correct),
                       **ro.metrics)
        metrics.update(completion_len=float(lengths.float().mean()),
                       truncated_frac=float(truncated.float().mean()),
                       nonfinite_rewards=float(algo.bad_rewards(rewards, a.max_abs_reward).sum()))
        if not self._kl_in_reward():
            metrics.update(self._set_advantages(batch, rewards))
        return batch, metrics

    def _kl_in_reward(self) -> bool:
        return self.cfg.algo.kl_in_reward and self.reference is not None

    def _set_advantages(self, batch: Batch, rewards: torch.Tensor) -> dict:
        """Group advantages of the real sequences' rewards [n] onto the batch's tokens."""
        a = self.cfg.algo
        if a.std_mode == "batch":  # a global batch std: gather over DP
            adv = _batch_std_advantages(rewards, a.group_size, a.std_eps, self.dp_group)
        else:
            adv = algo.group_advantages(rewards, a.group_size, a.std_mode, a.std_eps)
        batch.set_advantages(adv)
        return {"advantage_abs": float(adv.abs().mean())}

    def _kl_penalized_advantages(self, batch: Batch) -> dict:
        """KL in the reward (verl's apply_kl_penalty): r_i - beta * sum_t KL_t(old || ref) over
        the loss tokens, then group advantages, so equal KL within a group cancels. Needs the
        scoring pass's old and reference log-probs [N, S] (last stage); same KL clamp as the
        loss."""
        a = self.cfg.algo
        clamp = algo.kl_clamp(a.kl_estimator, a.kl_clamp_input, a.kl_clamp_output)
        n, S = int(batch.seq_valid.sum()), batch.ids.shape[1]
        mask = batch.real(batch.mask)
        # float64: a group's shaped rewards may differ by small KL sums, which the std scales up
        kl = kl_penalty(batch.real(batch.old_logp).double(), batch.real(batch.ref_logp).double(),
                        a.kl_estimator, clamp)
        rewards, m = algo.kl_penalized_rewards(
            batch.real(batch.rewards).double(), torch.where(mask, kl, 0.0).reshape(-1),
            mask.reshape(-1), torch.arange(n).repeat_interleave(S), a.beta)
        return dict(self._set_advantages(batch, rewards), **m)

    # ------------------------------------------------------------------ score
    def _plan(self, batch: Batch, m: int) -> list[MicroBatch]:
        """Micro-batches of `batch`: length-sorted and trimmed at pp = 1 (run.*micro_batch*)."""
        run = self.cfg.run
        budget = run.micro_batch_tokens
        if budget is None:  # automatic: pipeline stages exchange fixed shapes
            budget = DEFAULT_MICRO_BATCH_TOKENS if self.pp == 1 else 0
        return plan_micro_batches(batch, m, token_budget=budget,
                                  trim=run.trim_micro_batches and self.pp == 1,
                                  packed=self.packed)

    def _run(self, model, loss_fn, plan: list[MicroBatch], seq_length: int, m: int,
             forward_only: bool = False) -> list:
        """megatron's schedule over the planned micro-batches; the last stage's reports."""
        fwd = partial(_forward, loss_fn=loss_fn,
                      at_loss_positions=self.cfg.run.logits_at_loss_positions)
        return forward_backward(model, fwd, plan, len(plan), seq_length=seq_length,
                                micro_batch_size=m, forward_only=forward_only)

    def _logprobs(self, model, batch: Batch, rows: torch.Tensor | None = None
                  ) -> torch.Tensor | None:
        """Forward-only pass through the fused log-prob kernel; [N, S] on the last stage.
        `rows` [N] bool: score only those (0 elsewhere; at least one row runs)."""
        sub, idx = batch, None
        if rows is not None:
            idx = _row_index(rows)
            sub = batch.select(idx, batch.ids.shape[1])
        m = self.micro_size(batch.num_seqs)
        plan = self._plan(sub, m)
        out = self._run(model, partial(logprob_loss, self._ctx()), plan, sub.ids.shape[1], m,
                        forward_only=True)
        if not out:
            return None
        logp = unplan([o["logp"] for o in out], plan, tuple(sub.ids.shape))
        if idx is None:
            return logp
        full = torch.zeros(tuple(batch.ids.shape), dtype=logp.dtype)
        full[idx] = logp
        return full

    def score(self, batch: Batch, async_batch: bool) -> dict:
        """Old and reference log-probs (forward only; they live on the last stage, where the
        loss runs), the rollout-IS correction, and KL-in-reward."""
        a = self.cfg.algo
        need_old = (a.mu > 1 or self.cfg.run.num_minibatches > 1 or async_batch
                    or a.rollout_is != "none" or (a.kl_in_reward and self.reference is not None))
        metrics = {}
        # rows that will never train need no old log-probs (KL-in-reward needs every row's)
        keep = None if self._kl_in_reward() else self._gradient_rows(batch)
        if need_old:
            batch.old_logp = self._logprobs(self.policy, batch, keep)
        if self.reference is not None:
            if (keep is None and need_old and self.cfg.run.reuse_equal_reference
                    and self.reference.equals(unwrap(self.policy))):
                # same weights, same micro-batches: the reference pass would repeat the policy's
                # (the log-probs live on the last stage; None elsewhere, like any scoring pass)
                batch.ref_logp = None if batch.old_logp is None else batch.old_logp.clone()
                metrics["reference_pass_reused"] = 1.0
            else:
                self.reference.onload()
                batch.ref_logp = self._logprobs(self.reference.model, batch)
                self.reference.offload()
                metrics["reference_pass_reused"] = 0.0
        if self._kl_in_reward() and batch.old_logp is not None:  # the last stage
            metrics.update(self._kl_penalized_advantages(batch))
        if batch.old_logp is not None:
            metrics.update(self._rollout_is(batch, keep))
        return self._from_last_stage(metrics) if need_old else {}

    def _rollout_is(self, batch: Batch, keep: torch.Tensor | None) -> dict:
        """Rollout-IS weights / masks from old vs rollout log-probs, over the scored rows
        (`keep` [N] bool, None = all); the other rows keep their mask and weight 1."""
        a = self.cfg.algo
        mask = batch.mask if keep is None else batch.mask & keep[:, None]
        if a.rollout_is == "seq_mask":
            w, new_mask, metrics = self._seq_is(batch, mask)
        else:
            w, new_mask, metrics = algo.rollout_is_correction(
                batch.old_logp.reshape(-1), batch.rollout_logp.reshape(-1),
                mask.reshape(-1).float(), torch.zeros(0), mode=a.rollout_is,
                cap=a.rollout_is_cap, low=a.rollout_is_low, high=a.rollout_is_high,
                num_local_seqs=1)
        if a.rollout_is != "none":
            new_mask, w = new_mask.view_as(batch.mask).bool(), w.view_as(batch.mask)
            if keep is not None:
                new_mask = torch.where(keep[:, None], new_mask, batch.mask)
                w = torch.where(keep[:, None], w, torch.ones_like(w))
            batch.mask = new_mask
            batch.is_weight = w if a.rollout_is == "truncate" else None
        return metrics

    def _dp_mean(self, metrics: dict) -> dict:
        """Mean of per-replica scalars over the DP replicas (same keys on every rank)."""
        if self.dp == 1:
            return metrics
        keys = sorted(metrics)
        v = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
        dist.all_reduce(v, group=self.dp_group)
        return {k: x / self.dp for k, x in zip(keys, v.tolist())}

    def _from_last_stage(self, metrics: dict) -> dict:
        """Scalars computed on the last pipeline stage -> every rank, averaged over DP."""
        obj = [metrics]
        if self.pp > 1:
            dist.broadcast_object_list(obj, src=self.pp_last_rank, group=self.pp_group)
        return self._dp_mean(obj[0])

    def _seq_is(self, batch: Batch, mask: torch.Tensor):
        a = self.cfg.algo
        n, S = mask.shape
        seq_ids = torch.arange(n).repeat_interleave(S)
        return algo.rollout_is_correction(
            batch.old_logp.reshape(-1), batch.rollout_logp.reshape(-1),
            mask.reshape(-1).float(), seq_ids, mode="seq_mask", low=a.rollout_is_low,
            high=a.rollout_is_high, num_local_seqs=n)

    # ------------------------------------------------------------------ update
    def _ctx(self, **kw) -> LossContext:
        return LossContext(tp_group=self.tp_group, valid_local_vocab=self.valid_local_vocab,
                           temperature=self.cfg.rollout.temperature, impl=self.cfg.run.kernel_impl,
                           **kw)

    def _counts(self, mb: Batch, num_chunks: int) -> algo.LossCounts:
        """Global normalisers; `num_chunks` is this replica's micro-batch count (replicas may
        differ under run.micro_batch_tokens), summed over DP."""
        seqs = (mb.mask.any(dim=1) & mb.seq_valid).sum()
        local = torch.tensor([float(mb.mask.sum()), float(seqs), float(num_chunks)],
                             dtype=torch.float64)
        dist.all_reduce(local, group=self.dp_group)
        return algo.LossCounts(num_tokens=float(local[0]), num_seqs=float(local[1]),
                               max_len=float(self.cfg.algo.dr_grpo_max_len
                                             or self.cfg.rollout.max_tokens),
                               num_chunks=int(local[2]))

    def micro_size(self, num_seqs: int) -> int:
        """Sequences per micro-batch: run.micro_batch_size, or a whole minibatch if smaller
        (padding rows would only cost compute)."""
        per_mini = -(-num_seqs // self.cfg.run.num_minibatches)
        return max(1, min(self.cfg.run.micro_batch_size, per_mini))

    def update(self, batch: Batch, skip: bool = False) -> dict:
        """mu passes over the batch, each split into minibatches (one optimizer step each).

        A minibatch without a loss token in any replica is skipped (no optimizer step, no LR
        advance); so is a step whose gradient norm is not finite (`optimizer_step`), and the
        whole update when `skip` (bad rewards). Metrics cover the applied steps only."""
        run, a = self.cfg.run, self.cfg.algo
        n_mini = run.num_minibatches
        rows = batch.num_seqs // n_mini
        m = self.micro_size(batch.num_seqs)
        reports, gnorms, gap, empty, nonfinite = [], [], (0.0, 0.0), 0, 0
        for p in range(0 if skip else a.mu):
            for k in range(n_mini):
                mini = batch.rows(k * rows, (k + 1) * rows)
                if not self._has_loss_tokens(mini):
                    empty += 1
                    continue
                plan = self._plan(self._trained_rows(mini), m)
                ctx = self._ctx(scale=len(plan) * self.dp, counts=self._counts(mini, len(plan)),
                                algo=a, inplace_backward=run.inplace_backward)
                set_lr(self.optimizer, lr_at(self.cfg.optim, self.opt_steps, self.total_opt_steps))
                zero_grad(self.policy, self.optimizer)
                out = self._run(self.policy, partial(grpo_loss, ctx), plan, batch.ids.shape[1], m)
                applied, gnorm = optimizer_step(self.policy, self.optimizer)
                if not applied:
                    nonfinite += 1
                    continue
                if not gnorms and out:  # before any update: the weights vLLM sampled with
                    gap = _logp_gap(out, plan)
                self.opt_steps += 1
                reports += out
                gnorms.append(gnorm)
        metrics = self._update_metrics(reports, gnorms, gap, len(gnorms))
        metrics.update(skipped_minibatches=float(empty), nonfinite_grad=float(nonfinite),
                       update_skipped=float(not gnorms))
        return metrics

    def _gradient_rows(self, batch: Batch) -> torch.Tensor | None:
        """[N] bool: the rows whose loss has a gradient; None: all of them (or the lever is
        off). With no KL term in the loss, a sequence whose advantage is 0 (a group whose
        rewards are all equal) adds exactly 0 to loss and gradient for every loss_agg but bnpo
        (whose chunk means depend on the rows), so its forward and backward are skipped and
        its old log-probs are not scored (run.skip_zero_advantage); the normalisers still
        count it (`_counts` reads the whole minibatch). pp = 1 only: pipeline stages exchange
        fixed shapes, and under KL-in-reward only the last stage holds the advantages."""
        a = self.cfg.algo
        loss_kl = a.beta > 0 and not a.kl_in_reward and self.reference is not None
        if (not self.cfg.run.skip_zero_advantage or loss_kl or a.loss_agg == "bnpo"
                or self.pp > 1):
            return None
        keep = (batch.advantages != 0).any(dim=1) & batch.mask.any(dim=1)
        return None if bool(keep.all()) else keep

    def _trained_rows(self, mini: Batch) -> Batch:
        """`mini` without the rows `_gradient_rows` leaves out; one row is kept so every rank
        runs the schedule (its DP all-reduce)."""
        keep = self._gradient_rows(mini)
        return mini if keep is None else mini.select(_row_index(keep), mini.ids.shape[1])

    def _has_loss_tokens(self, mini: Batch) -> bool:
        """Whether any replica's minibatch holds a loss token; the same answer on every rank.
        The last stage's mask decides (rollout-IS masking changes it there only)."""
        last = self.rank == self.pp_last_rank and self.tp_rank == 0
        n = torch.tensor([float(mini.mask.sum()) if last else 0.0], dtype=torch.float64)
        dist.all_reduce(n)
        return bool(n.item() > 0)

    def _update_metrics(self, reports: list[dict], gnorms: list[float],
                        gap: tuple[float, float], opt_steps: int) -> dict:
        """Reduces the last stage's per-micro-batch reports over the world (TP rank 0 of the
        last stage of each replica contributes once); zeros when no step was applied."""
        keys = ["loss", "tokens", "kl_sum", "entropy_sum", "clip_low_sum", "clip_high_sum",
                "clip_dual_sum", "ratio_sum"]
        v = torch.zeros(len(keys) + 2, dtype=torch.float64)
        if reports and self.tp_rank == 0:
            for i, k in enumerate(keys):
                v[i] = sum(float(r[k]) for r in reports)
            v[-2], v[-1] = gap
        dist.all_reduce(v)
        tok = max(float(v[1]), 1.0)
        return {"loss": float(v[0]) / max(opt_steps, 1),  # chunk shares sum to a step's loss
                "kl": float(v[2]) / tok, "entropy": float(v[3]) / tok,
                "clip_frac_low": float(v[4]) / tok, "clip_frac_high": float(v[5]) / tok,
                "clip_frac_dual": float(v[6]) / tok, "ratio_mean": float(v[7]) / tok,
                "logp_gap_vllm_mean": float(v[-1]) / max(float(v[-2]), 1.0),
                "grad_norm": sum(gnorms) / max(len(gnorms), 1)}

    # ------------------------------------------------------------------ sync
    def sync_weights(self) -> dict:
        """Reshards the policy straight into vLLM: shard to shard when the engines' TP equals
        the training TP (each rank feeds its own slice), else full tensors (TP gather, PP
        broadcast, unfuse) of which vLLM keeps its slice."""
        from megagrpo.reshard import ReshardStats, iter_hf_weights, iter_vllm_slices

        stats = ReshardStats()
        feed = iter_vllm_slices if self.layout.shard_to_shard else iter_hf_weights
        pairs = feed(self.policy, self.model_cfg, self.cfg.parallel,
                     bucket_bytes=self.cfg.rollout.sync_bucket_mb << 20, stats=stats)
        s = self.engine.update_weights(pairs)
        self.engine_version = self.version
        return {"sync_bytes": stats.bytes, "sync_received_bytes": stats.received_bytes,
                "sync_gather_s": stats.gather_s,
                "sync_load_s": s.seconds - stats.gather_s - stats.convert_s}

    # ------------------------------------------------------------------ one step
    def step(self) -> dict:
        t = PhaseTimer(self.watchdog, step=self.step_idx + 1)  # phases name a stall
        with t("rollout"):
            ro = self._next_rollout()
        with t("advantage"):
            batch, metrics = self.build_batch(ro)
            metrics = self._dp_mean(metrics)  # each replica saw its own prompts
        async_batch = ro.version != self.version  # sampled by an older policy
        with t("score"):
            metrics.update(self.score(batch, async_batch))
        with t("update"):
            metrics.update(self.update(batch, skip=metrics["nonfinite_rewards"] > 0))
        self.version += int(not metrics["update_skipped"])
        with t("rollout_wait"):
            self._join_async()
        with t("weight_sync"):
            metrics.update(self.sync_weights())
        self.step_idx += 1
        with t("reference_sync"):
            metrics["reference_sync"] = self._reference_schedule(ro.epoch, metrics.get("kl"))
        metrics.update(t.times, step=self.step_idx, policy_version_of_batch=ro.version,
                       epoch=ro.epoch, lr=lr_at(self.cfg.optim, self.opt_steps - 1,
                                                self.total_opt_steps))
        gen_tokens = metrics["completion_len"] * batch.seq_valid.sum().item() * self.dp
        metrics["tokens_per_s"] = gen_tokens / max(sum(t.times.values()), 1e-9)
        self._check_bad_steps(metrics)
        return metrics

    def _check_bad_steps(self, metrics: dict) -> None:
        """Counts consecutive steps with bad rewards or a non-finite gradient (their updates
        were skipped) and raises `BadStepsError` at run.max_bad_steps in a row. Every rank sees
        the same counts (DP-averaged / all-reduced), so every rank raises together."""
        bad = metrics["nonfinite_rewards"] > 0 or metrics["nonfinite_grad"] > 0
        self.bad_steps = self.bad_steps + 1 if bad else 0
        metrics["bad_steps_in_a_row"] = self.bad_steps
        k = self.cfg.run.max_bad_steps
        if k and self.bad_steps >= k:
            raise BadStepsError(
                f"{self.bad_steps} steps in a row (up to step {self.step_idx}) had non-finite or "
                f"absurd rewards (|r| > algo.max_abs_reward={self.cfg.algo.max_abs_reward:g}) "
                "or a non-finite gradient norm; their updates were skipped, so the weights are "
                "those of the last good step. Check the reward function and the learning rate "
                "(run.max_bad_steps sets the limit, 0 = never stop)", metrics)

    def _next_rollout(self) -> Rollout:
        if not self.cfg.run.async_rollout:
            return self.rollout()
        drawn = self._pending if self._pending is not None else self._draw()
        self._pending = None
        ro = self.rollout(drawn)  # collectives (gather, dynamic-sampling top-ups) stay here
        # step t+1's batch is sampled with the engine's current weights while step t trains;
        # the thread runs no collectives (gloo groups are not for concurrent use)
        self._thread = threading.Thread(target=self._async_draw, daemon=True)
        self._thread.start()
        return ro

    def _async_draw(self) -> None:
        self._pending = self._draw()

    def _join_async(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _reference_schedule(self, epoch: int, kl: float | None) -> str:
        if self.reference is None:
            return ""
        reason = self.reference.due(self.step_idx, epoch, kl)
        if reason:
            self.reference.sync(self.policy, self.step_idx, epoch)
            if self.rank == 0:
                log.info("step %d: reference re-initialised (%s, alpha=%.2f)", self.step_idx,
                         reason, self.cfg.reference.alpha)
        return reason or ""

    # ------------------------------------------------------------------ eval / cold start
    def evaluate(self, examples) -> float:
        """Greedy accuracy on held-out examples, split over the vLLM engines: the share whose
        correctness term (`RewardFn.correct`) scores >= 1, whatever the other terms add."""
        if self.watchdog is not None:
            self.watchdog.set_phase("eval", self.step_idx)
        lay = self.layout  # each engine evaluates its slice; its TP rank 0 counts it
        mine = examples[lay.engine::lay.num_engines]
        correct = 0.0
        if mine:
            from megagrpo.rollout import SamplingSettings

            ids = [encode_prompt(self.tokenizer, e.prompt) for e in mine]
            s = SamplingSettings(temperature=0.0, max_tokens=self.cfg.run.eval_max_tokens, n=1,
                                 stop_token_ids=self.stop_ids)
            comps = self.engine.generate(ids, s)
            texts = [c.text or self.tokenizer.decode(c.token_ids) for c in comps]
            _, per_term, _ = self.reward_fn.score(texts, [e.answer for e in mine])
            correct = float(self.reward_fn.correct(per_term).sum())
        counted = float(len(mine)) if lay.is_leader else 0.0
        v = torch.tensor([correct if lay.is_leader else 0.0, counted], dtype=torch.float64)
        dist.all_reduce(v)
        return float(v[0] / max(v[1], 1.0))

    def cold_start(self, pairs_fn, steps: int) -> list[float]:
        """Supervised fine-tuning on (prompt, completion) pairs: NLL of completion tokens."""
        run = self.cfg.run
        per_dp = run.sft_batch_size // self.dp
        losses = []
        for s in range(steps):
            if self.watchdog is not None:  # each SFT step is a phase of its own
                self.watchdog.set_phase(f"cold_start {s + 1}/{steps}", self.step_idx)
            pairs = pairs_fn(per_dp, seed=run.seed * 100_003 + s * self.dp + self.dp_rank)
            prompts = [encode_prompt(self.tokenizer, p) for p, _ in pairs]
            comps = [self.tokenizer.encode(c) + [self.eos_id] for _, c in pairs]
            m = min(run.micro_batch_size, len(pairs))
            batch = sft_batch(prompts, comps, pad_id=self.pad_id, multiple=m)
            plan = self._plan(batch, m)
            ctx = self._ctx(scale=len(plan) * self.dp, counts=self._counts(batch, len(plan)),
                            inplace_backward=run.inplace_backward)
            ctx.temperature = 1.0
            set_lr(self.optimizer, run.sft_lr)
            zero_grad(self.policy, self.optimizer)
            out = self._run(self.policy, partial(sft_loss, ctx), plan, batch.ids.shape[1], m)
            optimizer_step(self.policy, self.optimizer)
            v = torch.tensor([sum(float(o["nll_sum"]) for o in out) if self.tp_rank == 0 else 0,
                              sum(float(o["tokens"]) for o in out) if self.tp_rank == 0 else 0],
                             dtype=torch.float64)
            dist.all_reduce(v)
            losses.append(float(v[0] / max(v[1], 1)))
            if self.rank == 0 and self.cfg.run.progress and (s + 1) % 50 == 0:
                print(f"cold start {s + 1:4d}/{steps} | nll={losses[-1]:.3f}", flush=True)
        return losses


# ---------------------------------------------------------------------- helpers
def _row_index(keep: torch.Tensor) -> torch.Tensor:
    """[N] bool -> the kept rows' indices; row 0 when none is kept, so every rank still runs
    megatron's schedule (and its collectives)."""
    idx = keep.nonzero().squeeze(1)
    return idx if idx.numel() else torch.zeros(1, dtype=torch.long)


def _logp_gap(reports: list[dict], plan: list[MicroBatch]) -> tuple[float, float]:
    """(valid tokens, sum |trainer logp - vLLM logp|) over a minibatch's micro-batch reports."""
    tokens, gap = 0.0, 0.0
    for r, mb in zip(reports, plan):
        mask = mb.batch.mask.float()
        tokens += float(mask.sum())
        gap += float(((r["logp"] - mb.batch.rollout_logp).abs() * mask).sum())
    return tokens, gap


def _sum_dicts(dicts: list[dict]) -> dict:
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            if isinstance(v, (int, float)):
                out[k] = out.get(k, 0) + v
    return out


def _any_rank(flag: bool) -> bool:
    t = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _select_groups(ro: Rollout, keep: torch.Tensor, G: int) -> Rollout:
    idx = [i for i in range(len(ro.prompts)) if bool(keep[i])]
    remap = {old: new for new, old in enumerate(idx)}
    comps = [c for c in ro.completions if c.prompt_index in remap]
    for c in comps:
        c.prompt_index = remap[c.prompt_index]
    rewards = ro.rewards.view(-1, G)[keep].reshape(-1) if idx else ro.rewards[:0]
    return Rollout(prompts=[ro.prompts[i] for i in idx], answers=[ro.answers[i] for i in idx],
                   completions=comps, rewards=rewards, version=ro.version, epoch=ro.epoch,
                   metrics=ro.metrics)


def _concat(a: Rollout, b: Rollout) -> Rollout:
    off = len(a.prompts)
    for c in b.completions:
        c.prompt_index += off
    return Rollout(prompts=a.prompts + b.prompts, answers=a.answers + b.answers,
                   completions=a.completions + b.completions,
                   rewards=torch.cat([a.rewards, b.rewards]), version=a.version, epoch=a.epoch,
                   metrics=a.metrics)


def _truncate(ro: Rollout, want: int, G: int) -> Rollout:
    if len(ro.prompts) <= want:
        return ro
    return Rollout(prompts=ro.prompts[:want], answers=ro.answers[:want],
                   completions=[c for c in ro.completions if c.prompt_index < want],
                   rewards=ro.rewards[: want * G], version=ro.version, epoch=ro.epoch,
                   metrics=ro.metrics)


def _batch_std_advantages(rewards: torch.Tensor, G: int, eps: float, dp_group) -> torch.Tensor:
    """Group-mean baseline divided by the std of the rewards of the whole (DP-global) batch."""
    stats = torch.tensor([rewards.sum(), (rewards ** 2).sum(), rewards.numel()],
                         dtype=torch.float64)
    dist.all_reduce(stats, group=dp_group)
    n = stats[2]
    mean = stats[0] / n
    std = ((stats[1] / n - mean ** 2) * n / max(n - 1, 1)).clamp(min=0).sqrt()
    centred = algo.group_advantages(rewards, G, "none")
    return (centred / (std.float() + eps)).float()


__all__ = ["BadStepsError", "Rollout", "TokenIds", "Trainer", "TrainerGroups", "TrainerRanks"]
