"""Iterative GRPO (DeepSeekMath, arXiv 2402.03300, Algorithm 1) on megatron-core TP/PP models.

`Trainer.step` is the spine and reads top to bottom:
  rollout -> reward -> advantage -> score (old / reference log-probs) -> [KL-in-reward
  advantages] -> rollout-IS correction -> update (mu passes x minibatches) -> weight sync to
  vLLM -> reference schedule -> log record.
Each stage returns a small typed result; control flow reads those (agreement across ranks is an
explicit all-reduce), and the log record is built once, at the end. The stages live in their
own modules: rollouts and evaluation (`megagrpo.rollout.collect`), batch building and advantages
(`megagrpo.train.advantage`), the forward/backward passes (`megagrpo.train.passes`), the reference
(`megagrpo.model.reference`), the cold start (`megagrpo.train.cold_start`, over `sft_step`),
checkpoints (`megagrpo.checkpoint`: a manager over the run's Stateful parts, of which this trainer's
`state_dict` is the replicated one, `train_state`).

Nothing wrong is trained on silently: minibatches without a loss token are skipped, and so is
the update of a step with non-finite / absurd rewards or a non-finite gradient norm;
run.max_bad_steps such steps in a row raise `BadStepsError`. Departures from the paper:
process supervision is not implemented (outcome rewards only); the reference can be mixed
(alpha < 1) as well as reset, at most once per policy version; async mode trains up to
k = rollout.max_staleness steps off-policy (`megagrpo.rollout.stream`), a stale sample with the
decoupled correction (`megagrpo.train.offpolicy`), one beyond k dropped or down-weighted.
"""
from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megagrpo.config.algo import AlgoConfig
from megagrpo.config.run import ComputeConfig
from megagrpo.config.train import TrainConfig
from megagrpo.data import encode_prompt
from megagrpo.model.gpt import sequence_packing, unwrap
from megagrpo.model.moe import routing_monitor
from megagrpo.model.optim import (
    build_optimizer,
    loss_scale,
    lr_at,
    optimizer_step,
    scaler_can_back_off,
    set_lr,
    zero_grad,
)
from megagrpo.parallel.batch import Batch, MicroBatch, sft_batch
from megagrpo.rollout.collect import RolloutCollector
from megagrpo.rollout.stream import Rollout
from megagrpo.runtime.distributed import Groups, Ranks, any_rank
from megagrpo.runtime.metrics import PhaseTimer
from megagrpo.train.advantage import advantages, build_batch, kl_penalized_rewards, rollout_is
from megagrpo.train.balance import balance_batch, balance_enabled, balance_note
from megagrpo.train.cold_start import Pair, encode_completion
from megagrpo.train.losses import grpo_loss, sft_loss
from megagrpo.train.offpolicy import StalenessPolicy
from megagrpo.train.passes import Passes

if TYPE_CHECKING:
    from megagrpo.config.model import ModelConfig
    from megagrpo.engine import RolloutEngine
    from megagrpo.model.reference import Reference
    from megagrpo.runtime.watchdog import Watchdog
    from megagrpo.sync import WeightSync
    from megagrpo.tasks import Task
    from megagrpo.train.eval_target import EvalTarget

log = logging.getLogger("megagrpo")


@dataclass(frozen=True, kw_only=True)
class TokenIds:
    """Special token ids of the run's tokenizer."""

    pad_id: int = 0
    """Padding."""
    eos_id: int = 0
    """End of sequence."""
    stop_ids: tuple[int, ...] = ()
    """Token ids that end a completion."""


@dataclass
class ScoreResult:
    """The scoring pass: log-probs on the last stage (None elsewhere, and when not needed)."""

    old_logp: torch.Tensor | None = None
    """[N, S] the policy's log-probs before the update."""
    ref_logp: torch.Tensor | None = None
    """[N, S] the reference's log-probs."""
    rows: torch.Tensor | None = None
    """[N] bool: the rows that were scored (None: all)."""
    needed: bool = False
    """Old log-probs were needed (mu > 1, minibatches, async, rollout-IS or KL-in-reward)."""
    reference_reused: bool | None = None
    """The reference pass was taken from the old log-probs (None: no reference)."""


@dataclass
class Prepared:
    """What `Trainer.prepare` found on the way from rollout to batch."""

    bad_rewards: bool
    """Some replica has a non-finite or absurd reward (agreed over the world): skip the update."""
    scored: ScoreResult
    metrics: dict
    """Reward, advantage, scoring and rollout-IS scalars, DP-averaged (same on every rank)."""
    stale: bool = False
    """Some sample of the batch (on any rank) was drawn by another policy version."""


@dataclass
class UpdateResult:
    """The update stage: optimizer steps applied and what the loss reported over them."""

    applied: int = 0
    """Optimizer steps applied."""
    nonfinite_grad: int = 0
    """Optimizer steps skipped for a non-finite gradient norm."""
    scale_overflows: int = 0
    """fp16: optimizer steps skipped because the loss-scaled gradients overflowed while the
    dynamic scaler could still lower its scale (not a bad step: the scaler's probe)."""
    empty_minibatches: int = 0
    """Minibatches skipped because no replica held a loss token."""
    kl: float = 0.0
    """Mean KL to the reference over the applied steps' loss tokens."""
    metrics: dict = field(default_factory=dict)
    """Loss, entropy, clip fractions, ratio, grad norm, vLLM log-prob gap (world-reduced)."""


class BadStepsError(RuntimeError):
    """run.max_bad_steps consecutive steps skipped their update for non-finite values."""

    def __init__(self, message: str, metrics: dict):
        super().__init__(message)
        self.metrics = metrics
        """The last step's metrics (not yet logged)."""


class Trainer:
    """The run's training state and one GRPO iteration (`step`); `megagrpo.run.setup`
    builds it."""

    cfg: TrainConfig
    model_cfg: ModelConfig | None
    """The architecture (from run.init's checkpoint when it has one)."""
    policy: list | None
    """The policy's model chunks (DDP-wrapped megatron GPTModel stage)."""
    optimizer: object
    """megatron's optimizer over the policy (replaced after the cold start)."""
    reference: Reference | None
    """The reference model and its reset schedule (None when algo.beta = 0)."""
    rollouts: RolloutCollector | None
    """Samples, rewards and gathers rollouts; evaluates (holds the engine, loader, rewards)."""
    weight_sync: WeightSync | None
    """The policy's weights -> the engine after each update (`megagrpo.sync`)."""
    task: Task | None
    """Train/eval examples and the tokenizer."""
    ranks: Ranks
    groups: Groups
    tokens: TokenIds
    passes: Passes
    """The forward/backward drivers."""
    step_idx: int
    """GRPO steps done."""
    version: int
    """Optimizer updates applied to the policy (GRPO steps whose update ran)."""
    opt_steps: int
    """Optimizer steps taken (the LR schedule's position)."""
    total_opt_steps: int
    engine_version: int
    """The policy version vLLM holds (-1: none yet)."""
    bad_steps: int
    """Consecutive steps whose update was skipped for bad values."""
    watchdog: Watchdog | None
    """The run's stall watchdog (phases name a stall)."""
    staleness: StalenessPolicy
    """What a stale batch trains with (rollout.max_staleness, stale_policy, algo.rollout_is)."""
    eval_target: EvalTarget | None
    """eval.target_accuracy's bookkeeping (None: a Trainer built without evaluation)."""

    def __init__(self, cfg: TrainConfig, *, model_cfg: ModelConfig | None = None,
                 policy: list | None = None, optimizer=None, reference: Reference | None = None,
                 rollouts: RolloutCollector | None = None, task: Task | None = None,
                 ranks: Ranks | None = None, groups: Groups | None = None,
                 tokens: TokenIds | None = None, staleness: StalenessPolicy | None = None,
                 watchdog: Watchdog | None = None, eval_target: EvalTarget | None = None,
                 weight_sync: WeightSync | None = None):
        """`megagrpo.run.setup` builds every part; tests may leave out what they do not use
        (the staleness policy then comes from `cfg`)."""
        self.cfg, self.model_cfg, self.policy, self.optimizer = cfg, model_cfg, policy, optimizer
        self.reference, self.rollouts, self.task = reference, rollouts, task
        self.staleness = staleness or StalenessPolicy.from_config(cfg)
        self.watchdog, self.eval_target = watchdog, eval_target
        self.weight_sync = weight_sync
        self.ranks, self.groups = ranks or Ranks(), groups or Groups()
        self.tokens = tokens or TokenIds()
        self.passes = Passes(cfg, self.ranks, self.groups,
                             packed=sequence_packing(cfg.compute, cfg.parallel))
        self.step_idx, self.version, self.opt_steps, self.bad_steps = 0, 0, 0, 0
        self.total_opt_steps = max(1, cfg.run.steps * cfg.algo.mu * cfg.algo.num_minibatches)
        self.engine_version = -1
        self.routing = routing_monitor(self.policy, self.model_cfg, self.cfg.parallel,
                                       replay=self.cfg.algo.routing_replay,
                                       tp_rank=self.ranks.tp_rank, group=self.groups.world)
        note = balance_note(cfg.compute.balance_tokens, loss_agg=cfg.algo.loss_agg,
                            kl_in_reward=self.kl_in_reward, dp=self.ranks.dp)
        if note and self.ranks.rank == 0:
            log.info(note)

    @property
    def engine(self) -> RolloutEngine | None:
        """This rank's vLLM engine (the collector samples on it; `sync_weights` feeds it)."""
        return self.rollouts.engine if self.rollouts is not None else None

    @property
    def tokenizer(self):
        return self.task.tokenizer if self.task is not None else None

    @property
    def kl_in_reward(self) -> bool:
        """The KL penalty goes into the rewards (advantages wait for the scoring pass)."""
        return self.cfg.algo.kl_in_reward and self.reference is not None

    # ------------------------------------------------------------------ one step
    def step(self) -> dict:
        t = PhaseTimer(self.watchdog, step=self.step_idx + 1)  # phases name a stall
        with t("rollout"):
            ro = self.rollouts.next(self.engine_version)
        with t("reference_sync"):  # a new data epoch starts against a fresh reference
            reset_before = self._reset_reference(
                self.reference.due_before(ro.epoch) if self.reference else None, ro.epoch)
        batch, prep = self.prepare(ro, t)
        with t("update"):
            upd = self.update(batch, skip=prep.bad_rewards, stale=prep.stale)
        self.version += int(upd.applied > 0)
        self.step_idx += 1
        # a reset before the sync: a LoRA merge edits the policy (in bf16/fp16 its merged
        # weights move by the rounding the merge folds into B), so the engine samples the next
        # step with the policy as the trainer holds it, as a fresh engine fed from this step's
        # checkpoint would (a resume stays bitwise)
        with t("reference_sync"):
            reset_after = self._reset_reference(
                self.reference.due_after(self.step_idx, upd.kl) if self.reference else None,
                ro.epoch)
        with t("weight_sync"):  # in flight: the running draw loads them between decode steps
            self.weight_sync.post(self.policy, self.version)
        with t("rollout_wait"):
            self.rollouts.join()
        with t("weight_sync"):
            sync = self.sync_weights()
        reset = "+".join(r for r in (reset_before, reset_after) if r)
        bad = prep.bad_rewards or upd.nonfinite_grad > 0
        self.bad_steps = self.bad_steps + 1 if bad else 0
        record = self._record(ro, batch, t, prep.metrics, upd, sync, reset)
        record.update(self._stream_metrics(t))
        self._check_bad_steps(record)
        return record

    def prepare(self, ro: Rollout, t: PhaseTimer | None = None) -> tuple[Batch, Prepared]:
        """Rollout -> training batch: shaped rewards, advantages, old/reference log-probs and
        the rollout-IS correction. The advantages come before the scoring pass, or, with the
        KL penalty in the reward, after it (they need the old and reference log-probs)."""
        t, a = t or PhaseTimer(), self.cfg.algo
        with t("advantage"):
            batch, shaped = self.build_batch(ro)
            bad_rewards = any_rank(shaped.bad > 0, self.groups.world)
            replica = dict(shaped.metrics, prompt_digest=prompt_digest(ro.prompts))
            st = self.staleness
            lags = st.lags(ro, self.version)  # [n] per sample, from their versions
            stale = any_rank(bool((lags != 0).any()), self.groups.world)
            mode = st.mode(stale)
            replica.update(st.metrics(ro, self.version, lags, mode))
            replica["staleness_max"] = self._dp_max(float(lags.max()) if len(lags) else 0.0)
            batch.lags = self._rows(batch, lags)  # per row: balancing moves them with it
            st.bound(batch, lags, self.step_idx + 1, say=self.ranks.rank == 0)
            if not self.kl_in_reward:
                replica.update(self._set_advantages(batch, shaped.rewards, shaped.valid))
            replica = self._dp_mean(replica)  # each replica saw its own prompts
            batch, balanced = self.balance(batch)
            replica.update(balanced)  # already global
            scale = st.row_scale(batch.lags)
        with t("score"):
            scored = self.score(batch, async_batch=stale)
            batch.old_logp, batch.ref_logp = scored.old_logp, scored.ref_logp
            last = self._score_metrics(scored)  # computed where the log-probs live
            if self.kl_in_reward and batch.old_logp is not None:
                rewards, kl_metrics = kl_penalized_rewards(batch, a)
                last.update(self._set_advantages(batch, rewards, shaped.valid), **kl_metrics)
            if batch.old_logp is not None:
                corr = rollout_is(batch, scored.rows, a, mode=mode)
                batch.mask, batch.is_weight = corr.mask, corr.weight
                batch.is_weight = st.weights(batch.is_weight, batch.lags, batch.seq_valid,
                                             scale, mode, width=batch.mask.shape[1])
                last.update(corr.metrics)
            if scored.needed:
                replica.update(self._from_last_stage(last))
        return batch, Prepared(bad_rewards=bad_rewards, scored=scored, metrics=replica,
                               stale=stale)

    @staticmethod
    def _rows(batch: Batch, values: torch.Tensor) -> torch.Tensor:
        """Per-sequence values [n] -> per row [N] (padding rows: zero / False)."""
        row = torch.zeros(batch.num_seqs, dtype=values.dtype)
        row[batch.seq_valid] = values
        return row

    def _dp_max(self, value: float) -> float:
        """The max of a per-replica scalar over the DP replicas (kept out of `_dp_mean`)."""
        if self.ranks.dp == 1:
            return value
        v = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(v, op=dist.ReduceOp.MAX, group=self.groups.dp)
        return float(v.item())

    def _stream_metrics(self, t: PhaseTimer) -> dict:
        """The rollout stream's step figures (docs/metrics.md): batches queued ahead, the
        trainer's wait for samples (its rollout and rollout_wait phases) and the engines'
        time without a draw (the step's wall time less the seconds spent sampling)."""
        stats = self.rollouts.stats
        wall = sum(t.times.values())
        waited = t.times.get("time_rollout", 0.0) + t.times.get("time_rollout_wait", 0.0)
        return {"rollout_queue_depth": float(stats.queue_depth), "trainer_idle_s": waited,
                "rollout_idle_s": max(0.0, wall - stats.draw_s)}

    def _record(self, ro: Rollout, batch: Batch, t: PhaseTimer, prepared: dict,
                upd: UpdateResult, sync: dict, reset: str) -> dict:
        """The step's log record, built once from the stages' results."""
        record = dict(prepared)
        record.update(upd.metrics, skipped_minibatches=float(upd.empty_minibatches),
                      nonfinite_grad=float(upd.nonfinite_grad),
                      loss_scale_overflows=float(upd.scale_overflows),
                      update_skipped=float(upd.applied == 0))
        record.update(sync)
        record["reference_sync"] = reset
        record.update(t.times, step=self.step_idx, policy_version_of_batch=ro.version,
                      epoch=ro.epoch, lr=lr_at(self.cfg.optim, self.opt_steps - 1,
                                               self.total_opt_steps))
        # the rollout's own count: balancing may have moved sequences between replicas
        gen_tokens = record["completion_len"] * len(ro.completions) * self.ranks.dp
        record["tokens_per_s"] = gen_tokens / max(sum(t.times.values()), 1e-9)
        record["bad_steps_in_a_row"] = self.bad_steps
        return record

    def _check_bad_steps(self, record: dict) -> None:
        """Raises `BadStepsError` at run.max_bad_steps skipped steps in a row. Every rank
        counts alike (the bad-rewards flag and the gradient norm are agreed over the world)."""
        k = self.cfg.run.max_bad_steps
        if k and self.bad_steps >= k:
            raise BadStepsError(
                f"{self.bad_steps} steps in a row (up to step {self.step_idx}) had non-finite or "
                f"absurd rewards (|r| > algo.max_abs_reward={self.cfg.algo.max_abs_reward:g}) "
                "or a non-finite gradient norm; their updates were skipped, so the weights are "
                "those of the last good step. Check the reward function and the learning rate "
                "(run.max_bad_steps sets the limit, 0 = never stop)", record)

    # ------------------------------------------------------------------ rollout, advantage
    def rollout(self) -> Rollout:
        """A synchronous rollout with the weights vLLM holds (tests, benchmarks)."""
        return self.rollouts.rollout(self.engine_version)

    def build_batch(self, ro: Rollout):
        """The rollout packed into a `Batch` (advantages 0) and its `ShapedRewards`."""
        multiple = self.passes.micro_size(len(ro.completions)) * self.cfg.algo.num_minibatches
        return build_batch(ro, self.cfg, pad_id=self.tokens.pad_id, multiple=multiple,
                           vlm=self.model_cfg if self.model_cfg and self.model_cfg.is_vlm
                           else None)

    def balance(self, batch: Batch) -> tuple[Batch, dict]:
        """The batch with its sequences moved between DP replicas by token count
        (compute.balance_tokens, `megagrpo.train.balance`); its token_imbalance metrics."""
        a = self.cfg.algo
        on = balance_enabled(self.cfg.compute.balance_tokens, loss_agg=a.loss_agg,
                             kl_in_reward=self.kl_in_reward, dp=self.ranks.dp)
        return balance_batch(batch, num_minibatches=a.num_minibatches,
                             per_micro=self.cfg.compute.micro_batch_size,
                             pad_id=self.tokens.pad_id, dp_rank=self.ranks.dp_rank,
                             dp=self.ranks.dp, group=self.groups.dp, enabled=on)

    def _set_advantages(self, batch: Batch, rewards: torch.Tensor,
                        valid: torch.Tensor | None = None) -> dict:
        adv = advantages(rewards, self.cfg.algo, self.groups.dp, valid)
        batch.set_advantages(adv)
        return {"advantage_abs": float(adv.abs().mean())}

    # ------------------------------------------------------------------ score
    def loss_has_kl(self) -> bool:
        a = self.cfg.algo
        return a.beta > 0 and not a.kl_in_reward and self.reference is not None

    def score(self, batch: Batch, async_batch: bool) -> ScoreResult:
        """Old and reference log-probs (forward only; they live on the last stage, where the
        loss runs). Rows that will never train need no old log-probs (KL-in-reward needs
        every row's)."""
        a = self.cfg.algo
        need_old = a.needs_old_logprobs(async_batch=async_batch, kl_in_reward=self.kl_in_reward)
        rows = None if self.kl_in_reward else self.passes.gradient_rows(batch,
                                                                        self.loss_has_kl())
        out = ScoreResult(rows=rows, needed=need_old)
        if need_old:
            out.old_logp = self.passes.logprobs(self.policy, batch, rows)
        if self.reference is None:
            return out
        out.reference_reused = (may_reuse_reference(self.cfg.compute, a, all_rows=rows is None,
                                                    old_scored=need_old)
                                and self.reference.equals(unwrap(self.policy),
                                                          group=self.groups.world))
        if out.reference_reused:
            # same weights, same micro-batches: the reference pass would repeat the policy's
            # (the log-probs live on the last stage; None elsewhere, like any scoring pass)
            out.ref_logp = None if out.old_logp is None else out.old_logp.clone()
        else:
            self.reference.onload()
            out.ref_logp = self.passes.logprobs(self.reference.model, batch)
            self.reference.offload()
        return out

    @staticmethod
    def _score_metrics(scored: ScoreResult) -> dict:
        if scored.reference_reused is None:
            return {}
        return {"reference_pass_reused": float(scored.reference_reused)}

    def _dp_mean(self, metrics: dict) -> dict:
        """Mean of per-replica scalars over the DP replicas (same keys on every rank)."""
        if self.ranks.dp == 1:
            return metrics
        keys = sorted(metrics)
        v = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
        dist.all_reduce(v, group=self.groups.dp)
        return {k: x / self.ranks.dp for k, x in zip(keys, v.tolist())}

    def _from_last_stage(self, metrics: dict) -> dict:
        """Scalars computed on the last pipeline stage -> every rank, averaged over DP."""
        obj = [metrics]
        if self.ranks.pp > 1:
            dist.broadcast_object_list(obj, src=self.ranks.pp_last_rank, group=self.groups.pp)
        return self._dp_mean(obj[0])

    # ------------------------------------------------------------------ update
    def update(self, batch: Batch, skip: bool = False, stale: bool = False) -> UpdateResult:
        """mu passes over the batch, each split into minibatches (one optimizer step each).

        A minibatch without a loss token in any replica is skipped (no optimizer step, no LR
        advance); so is a step whose gradient norm is not finite (`optimizer_step`), and the
        whole update when `skip` (bad rewards). Metrics cover the applied steps only. `stale`:
        the batch was sampled by another policy version (its vLLM gap is reported as
        logp_gap_stale_mean, not logp_gap_vllm_mean: docs/metrics.md)."""
        a, P = self.cfg.algo, self.passes
        n_mini = a.num_minibatches
        rows = batch.num_seqs // n_mini
        m = P.micro_size(batch.num_seqs)
        res = UpdateResult()
        reports, gnorms, gap = [], [], (0.0, 0.0)
        self.routing.reset()
        for _ in range(0 if skip else a.mu):
            for k in range(n_mini):
                mini = batch.rows(k * rows, (k + 1) * rows)
                if not P.has_loss_tokens(mini):
                    res.empty_minibatches += 1
                    continue
                plan = P.plan(P.trained_rows(mini, self.loss_has_kl()), m)
                ctx = P.loss_context(scale=len(plan) * self.ranks.dp,
                                     counts=P.counts(mini, len(plan)), algo=a,
                                     inplace_backward=self.cfg.compute.inplace_backward)
                set_lr(self.optimizer, lr_at(self.cfg.optim, self.opt_steps, self.total_opt_steps))
                zero_grad(self.policy, self.optimizer)
                out = P.run(self.policy, partial(grpo_loss, ctx), plan, batch.ids.shape[1], m)
                probing = scaler_can_back_off(self.optimizer)
                applied, gnorm = optimizer_step(self.policy, self.optimizer)
                if not applied and probing:  # fp16: the scaler lowers its scale and goes on
                    res.scale_overflows += 1
                    continue
                if not applied:
                    res.nonfinite_grad += 1
                    continue
                if not gnorms and out:  # before any update: vLLM's weights unless stale
                    gap = _logp_gap(out, plan)
                self.opt_steps += 1
                reports += out
                gnorms.append(gnorm)
        res.applied = len(gnorms)
        res.kl, res.metrics = self._update_metrics(reports, gnorms, gap, len(gnorms), stale)
        scale = loss_scale(self.optimizer)
        if scale is not None:  # fp16: the scale the next backward uses (after this update's)
            res.metrics["loss_scale"] = scale
        res.metrics.update(self.routing.metrics())
        return res

    def _update_metrics(self, reports: list[dict], gnorms: list[float],
                        gap: tuple[float, float], opt_steps: int,
                        stale: bool = False) -> tuple[float, dict]:
        """Reduces the last stage's per-micro-batch reports over the world (TP and CP rank 0
        of the last stage of each replica contributes once); zeros when no step was applied. Returns
        the mean KL (the reference schedule's input, a value of its own) and the metrics. The
        first minibatch's trainer-vs-vLLM gap is the same-version gap (logp_gap_vllm_mean) on
        a fresh batch; on a stale one it adds the policy lag (logp_gap_stale_mean)."""
        keys = ["loss", "tokens", "kl_sum", "entropy_sum", "clip_low_sum", "clip_high_sum",
                "clip_dual_sum", "ratio_sum"]
        v = torch.zeros(len(keys) + 2, dtype=torch.float64)
        if reports and self.ranks.reports:  # once per replica (CP ranks hold them whole)
            for i, k in enumerate(keys):
                v[i] = sum(float(r[k]) for r in reports)
            v[-2], v[-1] = gap
        dist.all_reduce(v, group=self.groups.world)
        tok = max(float(v[1]), 1.0)
        kl = float(v[2]) / tok
        metrics = {"loss": float(v[0]) / max(opt_steps, 1),  # chunk shares sum to a step's loss
                   "kl": kl, "entropy": float(v[3]) / tok,
                   "clip_frac_low": float(v[4]) / tok, "clip_frac_high": float(v[5]) / tok,
                   "clip_frac_dual": float(v[6]) / tok, "ratio_mean": float(v[7]) / tok,
                   ("logp_gap_stale_mean" if stale else "logp_gap_vllm_mean"):
                       float(v[-1]) / max(float(v[-2]), 1.0),
                   "grad_norm": sum(gnorms) / max(len(gnorms), 1)}
        return kl, metrics

    # ------------------------------------------------------------------ sync, reference
    def sync_weights(self) -> dict:
        """The engine gets the policy's weights (`megagrpo.sync.WeightSync`: its source,
        transforms and transport chosen at set-up); the sync metrics."""
        out = self.weight_sync.sync(self.policy, self.version)
        self.engine_version = self.version
        return out

    def _reset_reference(self, reason: str | None, epoch: int) -> str:
        """Re-initialises the reference in place when its schedule gave a `reason`; the reason,
        or ''. A reset at a policy version the reference was already mixed with (a steps reset
        after step k, an epoch reset before step k + 1, no update between) moves the schedule
        but does not mix again: with alpha < 1 a second mix would make the effective alpha
        1 - (1 - alpha)^2."""
        if reason:
            mixed = self.reference.sync(self.policy, self.step_idx, epoch, version=self.version)
            if mixed:
                self._after_policy_edit()
            if self.ranks.rank == 0:
                log.info("step %d: reference re-initialised (%s, alpha=%.2f)%s", self.step_idx,
                         reason, self.cfg.reference.alpha,
                         "" if mixed else f": already mixed at policy version {self.version}, "
                         "not mixed again")
        return reason or ""

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, examples) -> float:
        """Greedy held-out accuracy with the weights vLLM holds (`RolloutCollector.evaluate`)."""
        if self.watchdog is not None:
            self.watchdog.set_phase("eval", self.step_idx)
        return self.rollouts.evaluate(examples)

    # ------------------------------------------------------------------ cold start
    def sft_step(self, pairs: list[Pair], lr: float) -> float:
        """One supervised step (the cold start's) on this rank's (prompt, completion[, record])
        pairs: NLL of the completion tokens (a trajectory's: the model's segments) and EOS, at
        temperature 1; a vision-language model's prompts expanded with their records' images
        as the rollout collector expands them. Returns the global NLL per trained token (the
        same on every rank)."""
        P, tok = self.passes, self.tokenizer
        prompts = [encode_prompt(tok, p[0]) for p in pairs]
        comps, masks = zip(*(encode_completion(tok, p[1], self.tokens.eos_id) for p in pairs))
        images, vlm = None, None
        if self.model_cfg is not None and self.model_cfg.is_vlm:  # one vision: colocated
            _, prompts, images = self.rollouts.vision.prepare(
                prompts, [p[2] if len(p) > 2 else {} for p in pairs])
            vlm = self.model_cfg
        m = min(self.cfg.compute.micro_batch_size, len(pairs))
        batch = sft_batch(prompts, list(comps), pad_id=self.tokens.pad_id, multiple=m,
                          loss_masks=list(masks), images=images, vlm=vlm)
        plan = P.plan(batch, m)
        ctx = P.loss_context(scale=len(plan) * self.ranks.dp, counts=P.counts(batch, len(plan)),
                             inplace_backward=self.cfg.compute.inplace_backward)
        ctx.temperature = 1.0
        set_lr(self.optimizer, lr)
        zero_grad(self.policy, self.optimizer)
        out = P.run(self.policy, partial(sft_loss, ctx), plan, batch.ids.shape[1], m)
        optimizer_step(self.policy, self.optimizer)
        mine = self.ranks.reports
        v = torch.tensor([sum(float(o["nll_sum"]) for o in out) if mine else 0.0,
                          sum(float(o["tokens"]) for o in out) if mine else 0.0],
                         dtype=torch.float64)
        dist.all_reduce(v, group=self.groups.world)
        return float(v[0] / max(v[1], 1))

    def restart_optimizer(self) -> None:
        """A fresh optimizer over the policy (no Adam moments, LR schedule at its start)."""
        self.optimizer = build_optimizer(self.policy, self.cfg.optim)

    def reset_reference(self) -> None:
        """The reference becomes an exact copy of the policy (its schedule is untouched)."""
        if self.reference is not None:
            self.reference.reinit(self.policy, 1.0)
            self._after_policy_edit()

    def _after_policy_edit(self) -> None:
        """A LoRA reference reset edits the policy's parameters in place (merge, B scaled):
        the optimizer's fp32 main copies (bf16/fp16, distributed optimizer) are re-read, A's
        Adam moments follow its gradient's scale, and an adapter-only refit sends the base
        next time."""
        if self.weight_sync is not None:
            self.weight_sync.base_changed()
        edits_policy = self.reference is not None and not self.reference.separate_model
        if edits_policy and self.optimizer is not None:
            self.optimizer.reload_model_params()
            self.reference.rescale_moments(self.optimizer)

    def phase(self, name: str) -> None:
        """Names what runs now for the stall watchdog."""
        if self.watchdog is not None:
            self.watchdog.set_phase(name, self.step_idx)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """The loop's position (JSON-able, the same on every rank): counters, the data loader,
        where it stood before the async batch drawn ahead, the reference schedule. The
        checkpoint's `train_state` part; the weights, optimizer, RNG streams and the async
        batch itself are parts of their own (`megagrpo.run.checkpoint_states`)."""
        ahead = self.rollouts.ahead_loader_states()  # oldest first; pending_loader: older name
        return {"step": self.step_idx, "version": self.version, "opt_steps": self.opt_steps,
                "bad_steps": self.bad_steps, "loader": self.rollouts.loader.state_dict(),
                "pending_loader": ahead[0] if ahead else None, "ahead_loaders": ahead,
                "reference": self.reference.state_dict() if self.reference else None}

    def load_state_dict(self, state: dict) -> None:
        """The counters, the schedule and the data position. Call after the batches drawn ahead
        were (or were not) restored as a part of their own: the prompts of those that were not
        (another layout, a smaller rollout.max_staleness, or none now) go back into the stream
        and are drawn again first, so no prompt is lost or trained twice."""
        loader = self.rollouts.loader
        loader.load_state_dict(state["loader"])
        if self.reference is not None and state["reference"] is not None:
            self.reference.load_state_dict(state["reference"])
        self.step_idx, self.version, self.opt_steps = (state["step"], state["version"],
                                                       state["opt_steps"])
        self.bad_steps = state["bad_steps"]
        ahead = state.get("ahead_loaders")
        if ahead is None:  # checkpoints of one pending batch at most
            ahead = [state["pending_loader"]] if state.get("pending_loader") is not None else []
        kept = len(self.rollouts.queue)
        if kept < len(ahead):
            self.rollouts.return_batches(ahead[kept:])
            if self.ranks.rank == 0:
                log.info("resume: %d of the batches drawn ahead for steps %d-%d are drawn again "
                         "from the same prompts (not restored: another layout, or a smaller "
                         "rollout.max_staleness now)", len(ahead) - kept,
                         self.step_idx + 1 + kept, self.step_idx + len(ahead))


def may_reuse_reference(compute: ComputeConfig, algo: AlgoConfig, *, all_rows: bool,
                        old_scored: bool) -> bool:
    """Whether the reference pass may be taken from the old log-probs when the reference equals
    the policy (compute.reuse_equal_reference): every row scored with old log-probs, and not
    under routing replay, where the policy's scoring routes by vLLM's experts while the
    reference routes by itself (their log-probs differ even with equal weights)."""
    return (compute.reuse_equal_reference and all_rows and old_scored
            and not algo.routing_replay)


def prompt_digest(prompts: list[list[int]]) -> float:
    """crc32 of a replica's prompt token ids in order (the step record holds its mean over the
    DP replicas): equal at a step in two runs when they trained the same prompts there, which
    a resumed run that is not bitwise (in-flight updates, another layout) is checked by."""
    crc = 0
    for ids in prompts:
        crc = zlib.crc32(b",".join(str(i).encode() for i in ids) + b";", crc)
    return float(crc)


def _logp_gap(reports: list[dict], plan: list[MicroBatch]) -> tuple[float, float]:
    """(valid tokens, sum |trainer logp - vLLM logp|) over a minibatch's micro-batch reports
    (the plan's tensors on the host, the reports' on the model's device: compared on the host)."""
    tokens, gap = 0.0, 0.0
    for r, mb in zip(reports, plan):
        mask = mb.batch.mask.float()
        tokens += float(mask.sum())
        logp = r["logp"].to(mask.device)
        gap += float(((logp - mb.batch.rollout_logp).abs() * mask).sum())
    return tokens, gap


__all__ = ["BadStepsError", "ScoreResult", "TokenIds", "Trainer", "UpdateResult",
           "may_reuse_reference"]
