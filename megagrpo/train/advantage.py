"""From a rollout to a training batch: shaped rewards, packing, group-relative advantages (also
with the KL penalty in the reward, which needs the scoring pass first) and the rollout-IS
correction of the loss mask and weights. Pure functions of the batch; the trainer's `step`
calls them in the order the config asks for."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megagrpo import algo
from megagrpo.agent.runner import agent_metrics
from megagrpo.config.algo import AlgoConfig
from megagrpo.config.train import TrainConfig
from megagrpo.engine.columns import SampleColumns
from megagrpo.kernels import kl_penalty
from megagrpo.parallel.batch import Batch, pack
from megagrpo.rollout.stream import Rollout


@dataclass
class ShapedRewards:
    """A rollout's rewards after overlong shaping, per real sequence."""

    rewards: torch.Tensor
    """[n] fp32 shaped rewards, sequence order."""
    bad: int
    """Sequences whose reward is non-finite or above algo.max_abs_reward."""
    metrics: dict
    """Reward, pass-rate, length and truncation scalars of this replica."""
    valid: torch.Tensor | None = None
    """[n] bool: the samples that train (None: all); a dropped one (`Completion.dropped`)
    leaves its group's advantage statistics and has no loss."""


@dataclass
class Correction:
    """The rollout-IS correction: the loss mask and weights to train with."""

    mask: torch.Tensor
    """[N, S] bool loss mask (tokens or sequences outside the IS bounds dropped)."""
    weight: torch.Tensor | None
    """[N, S] fp32 truncated IS weights (None: no weighting)."""
    metrics: dict


def build_batch(ro: Rollout, cfg: TrainConfig, *, pad_id: int, multiple: int,
                vlm=None) -> tuple[Batch, ShapedRewards]:
    """Packs the rollout (rows padded to a multiple of `multiple`, the padding spread over the
    algo.num_minibatches minibatches) with its shaped rewards; advantages are still 0. `vlm`:
    a vision-language model's ModelConfig (each row gets its prompt's images and the 3-D
    positions)."""
    a = cfg.algo
    cols = SampleColumns.of(ro.completions)  # columns: each row's tokens read as a view
    index = cols.column("prompt_index").tolist()  # each row's prompt
    prompts = [ro.prompts[i] for i in index]
    lengths = cols.column("tokens")
    model_lengths = cols.model_lengths()
    truncated = cols.is_value("finish_reason", "length")
    rewards = ro.rewards.float()
    if a.overlong_buffer:
        rewards = rewards + _overlong(lengths, prompts, cfg)
    dropped = ~cols.is_value("dropped", "")
    valid = ~dropped if bool(dropped.any()) else None
    keep = ~truncated if a.mask_truncated else None
    if valid is not None:
        keep = valid if keep is None else keep & valid
    routes = cols.route_rows()
    batch = pack(prompts, cols.rows("token_ids"), cols.rows("logprobs"),
                 torch.zeros(len(rewards)), pad_id=pad_id, multiple=multiple,
                 blocks=a.num_minibatches, completion_mask=keep, seq_rewards=rewards,
                 routes=routes if routes and routes[0] is not None else None,
                 loss_masks=cols.rows("loss_mask"),
                 images=(None if ro.images is None
                         else [ro.images[i] for i in index]),
                 vlm=vlm)
    correct = cols.column("correct") == 1
    bad = int(algo.bad_rewards(rewards, a.max_abs_reward).sum())
    metrics = dict(algo.reward_metrics(ro.rewards.float(), a.group_size, correct), **ro.metrics)
    metrics.update(completion_len=float(model_lengths.float().mean()),
                   truncated_frac=float(truncated.float().mean()), nonfinite_rewards=float(bad),
                   dropped_frac=float(dropped.float().mean()))
    if cfg.agent.enabled:
        metrics.update(agent_metrics(ro.completions),
                       trajectory_len=float(lengths.float().mean()))
    return batch, ShapedRewards(rewards=rewards, bad=bad, metrics=metrics, valid=valid)


def _overlong(lengths: torch.Tensor, prompts: list[list[int]], cfg: TrainConfig) -> torch.Tensor:
    """DAPO's overlong penalty [n]: each sample's tokens after its prompt against the limit that
    truncates it (`TrainConfig.length_limits`: one turn's rollout.max_tokens, or a trajectory's
    budget); the penalty depends on length - limit only."""
    limits = torch.tensor(cfg.length_limits([len(p) for p in prompts]))
    return algo.overlong_penalty(lengths - limits, 0, cfg.algo.overlong_buffer,
                                 cfg.algo.overlong_penalty)


def advantages(rewards: torch.Tensor, a: AlgoConfig, dp_group=None,
               valid: torch.Tensor | None = None) -> torch.Tensor:
    """[n] group advantages of the real sequences' rewards [n] (algo.std_mode; 'batch' takes
    the std of the DP-global batch, a collective over `dp_group`). `valid` [n]: the samples
    that count (`algo.group_advantages`; None: all)."""
    if a.std_mode == "batch":
        return _batch_std_advantages(rewards, a.group_size, a.std_eps, dp_group, valid)
    return algo.group_advantages(rewards, a.group_size, a.std_mode, a.std_eps, valid)


def kl_penalized_rewards(batch: Batch, a: AlgoConfig) -> tuple[torch.Tensor, dict]:
    """KL in the reward (verl's apply_kl_penalty): r_i - beta * sum_t KL_t(old || ref) over the
    loss tokens, [n] float64, so equal KL within a group cancels in the advantages. Needs the
    scoring pass's old and reference log-probs [N, S] (last stage); same KL clamp as the
    loss."""
    clamp = algo.kl_clamp(a.kl_estimator, a.kl_clamp_input, a.kl_clamp_output)
    n, S = int(batch.seq_valid.sum()), batch.ids.shape[1]
    mask = batch.real(batch.mask)
    # float64: a group's shaped rewards may differ by small KL sums, which the std scales up
    kl = kl_penalty(batch.real(batch.old_logp).double(), batch.real(batch.ref_logp).double(),
                    a.kl_estimator, clamp)
    return algo.kl_penalized_rewards(
        batch.real(batch.rewards).double(), torch.where(mask, kl, 0.0).reshape(-1),
        mask.reshape(-1), torch.arange(n).repeat_interleave(S), a.beta)


def rollout_is(batch: Batch, scored_rows: torch.Tensor | None, a: AlgoConfig,
               mode: str | None = None) -> Correction:
    """Rollout-IS weights / masks from old vs rollout log-probs over the scored rows
    (`scored_rows` [N] bool, None = all); the other rows keep their mask and weight 1.
    `mode`: the mode to run (None = algo.rollout_is; a stale batch's is
    `megagrpo.train.offpolicy.correction_mode`)."""
    mode = a.rollout_is if mode is None else mode
    mask = batch.mask if scored_rows is None else batch.mask & scored_rows[:, None]
    old, rollout = batch.old_logp.reshape(-1), batch.rollout_logp.reshape(-1)
    if mode == "seq_mask":
        n, S = mask.shape
        w, new_mask, metrics = algo.rollout_is_correction(
            old, rollout, mask.reshape(-1).float(), torch.arange(n).repeat_interleave(S),
            mode="seq_mask", low=a.rollout_is_low, high=a.rollout_is_high, num_local_seqs=n)
    else:
        w, new_mask, metrics = algo.rollout_is_correction(
            old, rollout, mask.reshape(-1).float(), torch.zeros(0), mode=mode,
            cap=a.rollout_is_cap, low=a.rollout_is_low, high=a.rollout_is_high,
            num_local_seqs=1)
    if mode == "none":
        return Correction(mask=batch.mask, weight=batch.is_weight, metrics=metrics)
    new_mask, w = new_mask.view_as(batch.mask).bool(), w.view_as(batch.mask)
    if scored_rows is not None:
        new_mask = torch.where(scored_rows[:, None], new_mask, batch.mask)
        w = torch.where(scored_rows[:, None], w, torch.ones_like(w))
    return Correction(mask=new_mask, weight=w if mode == "truncate" else None,
                      metrics=metrics)


def _batch_std_advantages(rewards: torch.Tensor, G: int, eps: float, dp_group,
                          valid: torch.Tensor | None = None) -> torch.Tensor:
    """Group-mean baseline divided by the std of the (valid) rewards of the whole (DP-global)
    batch."""
    counted = rewards if valid is None else rewards[valid]
    stats = torch.tensor([counted.sum(), (counted ** 2).sum(), counted.numel()],
                         dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(stats, group=dp_group)
    n = stats[2]
    mean = stats[0] / n
    std = ((stats[1] / n - mean ** 2) * n / max(n - 1, 1)).clamp(min=0).sqrt()
    centred = algo.group_advantages(rewards, G, "none", valid=valid)
    return (centred / (std.float() + eps)).float()
