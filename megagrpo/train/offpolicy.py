"""Stale batches: which off-policy correction trains them, decided from the batch's version.

A sample is *stale* when the policy version that sampled it (`Completion.version`, the optimizer
updates vLLM's weights had taken) differs from the trainer's when it trains on it: async
rollouts (rollout.max_staleness = k >= 1; run.async_rollout is k = 1) sample the next batches
while the current one trains, so they are up to k updates behind (`megagrpo.rollout.stream`); a
batch is stale when any of its samples is. Three policies then meet in the loss (decoupled PPO;
Fu et al., AReaL, arXiv:2505.24298, Sec. 5.1):

- behaviour mu: the policy that sampled the tokens; its per-token log-probs are vLLM's
  (`Batch.rollout_logp`);
- proximal pi_prox: the trainer's policy at training time, before this batch's first update;
  its log-probs are the scoring pass's (`Batch.old_logp`);
- pi_theta: the policy being optimised.

Per token, with advantage A:

    loss_t = min(pi_prox / mu, cap) * (max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))
                                       + beta * kl_t),
    r = pi_theta / pi_prox

The clip keeps each update in a trust region around the proximal policy (the trainer's own,
as on-policy PPO), and the truncated importance weight pi_prox / mu (no gradient) moves the
expectation over mu's samples to one over pi_prox's: E_mu[(pi_prox / mu) g] = E_pi_prox[g].
Without it (the PPO ratio is 1 at the first pass, as old log-probs are recomputed under the
trainer's weights) a stale batch follows mu's gradient, not the policy's: biased, by as much
as the one-update lag moved the policy. The weight covers the KL term too (k1/k2/k3/k3_is
of the reference, `megagrpo.kernels.loss_from_logp`): its samples are mu's as well, so
unweighted its gradient would be mu's expectation, not pi_prox's (on
tests/test_offpolicy_kl.py's 6-outcome bandit: 15-29% off at a total variation of 0.04
between them, 1.2-2.3x off at 0.31; with the weight, 1e-7). The advantage A is not
corrected: its group baseline is the mean reward of mu's samples (docs/metrics.md).

That objective is exactly `algo.rollout_is=truncate` (weights min(exp(old_logp -
rollout_logp), algo.rollout_is_cap) times the clipped ratio to old_logp), which on a fresh
batch corrects only the vLLM-vs-trainer numerical mismatch. So `algo.rollout_is=none` (the
default: no correction of that mismatch) runs `truncate` on every stale batch, and says so once
at start (`async_note`); token_mask / seq_mask / truncate chosen explicitly run as chosen on
every batch. The decision is per sample, from the versions, not from the async flag: the first
async batch (sampled before any update) is fresh and trains uncorrected, and in a batch that
mixes versions (dynamic-sampling top-ups drawn with the newest weights) the decoupled default
weights only the stale samples (`sample_weights`).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from megagrpo.config.algo import AlgoConfig
from megagrpo.engine.types import model_versions
from megagrpo.rollout.stream import over_stale, sample_lags, stale_weights

if TYPE_CHECKING:
    from megagrpo.config.rollout import RolloutConfig
    from megagrpo.config.run import RunConfig
    from megagrpo.config.train import TrainConfig
    from megagrpo.parallel.batch import Batch
    from megagrpo.rollout.stream import Rollout

log = logging.getLogger("megagrpo")


def is_stale(batch_version: int, trainer_version: int) -> bool:
    """Whether a batch sampled by policy `batch_version` trains on another policy version."""
    return batch_version != trainer_version


def correction_mode(rollout_is: str, *, stale: bool) -> str:
    """The rollout-IS mode a batch trains with: `algo.rollout_is`, except that 'none' on a
    stale batch is 'truncate' (the decoupled objective, module docstring)."""
    return "truncate" if stale and rollout_is == "none" else rollout_is


def sample_weights(weight: torch.Tensor | None, fresh_rows: torch.Tensor,
                   scale_rows: torch.Tensor | None, *, default_ran: bool, width: int
                   ) -> torch.Tensor | None:
    """The per-token importance weights [N, S] after the per-sample rules: when the decoupled
    default ran (`default_ran`: algo.rollout_is=none on a stale batch) the rows sampled by the
    training version (`fresh_rows` [N] bool) keep weight 1, as a fresh batch would; `scale_rows`
    [N] (rollout.stale_policy=weight, None: off) scales each row's weights (1 where absent;
    `width` = S)."""
    if default_ran and weight is not None and bool(fresh_rows.any()):
        weight = torch.where(fresh_rows[:, None], torch.ones_like(weight), weight)
    if scale_rows is not None:
        base = weight if weight is not None else torch.ones(scale_rows.shape[0], width)
        weight = base * scale_rows[:, None].to(base.dtype)
    return weight


def async_note(a: AlgoConfig, k: int = 1, stale_policy: str = "drop") -> str:
    """The start-up line of an async run (k = rollout.max_staleness >= 1): how far behind its
    batches are and which correction its stale samples train with."""
    if a.rollout_is == "none":
        how = ("corrected by the decoupled objective (algo.rollout_is=none runs truncate on "
               "stale batches: the clipped ratio to the recomputed old log-probs times "
               f"min(old/vLLM, algo.rollout_is_cap={a.rollout_is_cap:g})); set "
               "algo.rollout_is=truncate to choose it explicitly")
    else:
        how = f"weighted by algo.rollout_is={a.rollout_is} (trainer old log-probs vs vLLM's)"
    if k == 1:
        return ("async rollouts: each batch is sampled by the policy one update behind the one "
                f"that trains on it; that staleness is {how}")
    return (f"async rollouts (rollout.max_staleness={k}): up to {k} batches are drawn ahead, "
            f"each sampled by a policy up to {k} updates behind the one that trains on it "
            f"(samples older than that: rollout.stale_policy={stale_policy}); that staleness "
            f"is {how}")


def token_lag_metrics(ro: Rollout, trainer_version: int, k: int | None = None) -> dict:
    """Per-token staleness of a batch with in-flight updates or partial rollouts: token_lag_mean
    (updates between the weights that sampled each completion token and the trainer's) and
    inflight_mixed_samples (completions sampled by more than one version); with `k` (the
    staleness bound) the distribution: token_lag_share_{l}, the share of the tokens at lag l,
    for l = 0..k."""
    lags = [trainer_version - v for c in ro.completions for v in model_versions(c)]
    mixed = sum(len(set(model_versions(c))) > 1 for c in ro.completions)
    out = {"token_lag_mean": sum(lags) / len(lags) if lags else 0.0,
           "inflight_mixed_samples": float(mixed)}
    for lag in range(k + 1 if k is not None else 0):
        out[f"token_lag_share_{lag}"] = (sum(x == lag for x in lags) / len(lags)) if lags else 0.0
    return out


class StalenessPolicy:
    """What a batch's staleness does to its training, from the samples' lags (updates between
    the policy that sampled each one and the trainer's): which correction it trains with
    (`correction_mode`), which samples beyond k = rollout.max_staleness leave the loss or are
    down-weighted (rollout.stale_policy), the per-token weights, and the staleness metrics.
    Built once by `megagrpo.run.setup` and handed to the Trainer, which calls it and holds no
    staleness rule of its own. It reads its settings from the config sections it was built
    over (a run's config is frozen; a test that changes one between steps is followed)."""

    def __init__(self, rollout: RolloutConfig, algo: AlgoConfig, run: RunConfig):
        self._rollout, self._algo, self._run = rollout, algo, run

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> StalenessPolicy:
        return cls(cfg.rollout, cfg.algo, cfg.run)

    @property
    def k(self) -> int:
        """rollout.max_staleness (unset: 1 with run.async_rollout, else 0)."""
        return self._rollout.staleness(self._run.async_rollout)

    @property
    def stale_policy(self) -> str:
        """rollout.stale_policy: 'drop' or 'weight'."""
        return self._rollout.stale_policy

    @property
    def rollout_is(self) -> str:
        """algo.rollout_is: 'none' runs the decoupled objective on stale batches."""
        return self._algo.rollout_is

    @property
    def per_token(self) -> bool:
        """rollout.inflight_updates or rollout.partial_rollouts: tokens carry their own
        versions (token_lag metrics)."""
        return self._rollout.inflight_updates or self._rollout.partial_rollouts

    def lags(self, ro: Rollout, version: int) -> torch.Tensor:
        """[n] int64 per sample: updates between its sampling policy and `version`."""
        return sample_lags(ro, version)

    def mode(self, stale: bool) -> str:
        """The rollout-IS mode the batch trains with (stale: any sample on any rank lags)."""
        return correction_mode(self.rollout_is, stale=stale)

    def metrics(self, ro: Rollout, version: int, lags: torch.Tensor, mode: str) -> dict:
        """The replica's staleness scalars: policy_lag (batch), offpolicy_corrected (the
        decoupled default ran), staleness_mean, stale_dropped / stale_weighted (samples beyond
        k), with in-flight updates the per-token lags. staleness_max is the caller's to reduce
        over replicas (`lags.max()`)."""
        n_over = int(over_stale(lags, self.k).sum())
        out = {"policy_lag": float(version - ro.version),
               "offpolicy_corrected": float(mode != self.rollout_is),
               "staleness_mean": float(lags.double().mean()) if len(lags) else 0.0,
               "stale_dropped": float(n_over if self.stale_policy == "drop" else 0),
               "stale_weighted": float(n_over if self.stale_policy == "weight" else 0)}
        if self.per_token:
            out.update(token_lag_metrics(ro, version, self.k))
        return out

    def bound(self, batch: Batch, lags: torch.Tensor, step: int, *, say: bool) -> None:
        """Checks every sample's lag [n] against k. Beyond it, 'drop' takes the sample's tokens
        out of `batch.mask` (the sequence count still counts it, as a rollout-IS seq_mask
        rejection; the token count does not: docs/async.md); 'weight' leaves them to
        `row_scale` (after token balancing). `batch.lags` holds the same lags per row; `say`:
        this rank logs the warning."""
        n_over = int(over_stale(lags, self.k).sum())
        if n_over and say:
            log.warning("step %d: %d samples are more than rollout.max_staleness=%d versions old "
                        "(lag up to %d): %s (rollout.stale_policy=%s)", step, n_over, self.k,
                        int(lags.max()), "dropped from the loss" if self.stale_policy == "drop"
                        else "their loss scaled by (k + 1) / (lag + 1)", self.stale_policy)
        if n_over and self.stale_policy == "drop":
            batch.mask = batch.mask & ~over_stale(batch.lags, self.k)[:, None]

    def row_scale(self, row_lags: torch.Tensor) -> torch.Tensor | None:
        """rollout.stale_policy=weight: the per-row loss scale [N] of a replica's rows (their
        lags after balancing), None where none is beyond k."""
        if self.stale_policy != "weight" or not bool(over_stale(row_lags, self.k).any()):
            return None
        return stale_weights(row_lags, self.k)

    def weights(self, weight: torch.Tensor | None, row_lags: torch.Tensor, valid: torch.Tensor,
                scale: torch.Tensor | None, mode: str, width: int) -> torch.Tensor | None:
        """The per-token importance weights [N, S] after the per-sample rules
        (`sample_weights`): fresh rows (valid, lag 0) keep weight 1 where the decoupled
        default ran; `scale` [N] from `row_scale`."""
        return sample_weights(weight, valid & (row_lags == 0), scale,
                              default_ran=mode != self.rollout_is, width=width)



def start_line(cfg) -> str | None:
    """The start-up line of an async run (`cfg`: its TrainConfig; None when it samples
    on-policy): what its staleness means and which correction runs (`async_note`)."""
    if not cfg.staleness:
        return None
    return async_note(cfg.algo, cfg.staleness, cfg.rollout.stale_policy) + partial_note(cfg)


def partial_note(cfg) -> str:
    """What rollout.partial_rollouts does to the draw (the start-up line's tail; '' off)."""
    r = cfg.rollout
    if not r.partial_rollouts:
        return ""
    cap = r.partial_max_updates or cfg.staleness
    what = ("; partial rollouts: at each weight update the running draw pauses between two "
            "decode steps and continues with the new weights (every token stamped with the "
            "version that sampled it)")
    if cfg.agent.enabled:
        resume = ("a resume continues paused trajectories whose environment saves its state "
                  "(Environment.state_dict), the others restart from their prompt"
                  if r.placement == "colocated" else
                  "a checkpoint is taken between draws: it holds none paused")
        what += ("; multi-turn: a turn is paused mid-turn the same way, a trajectory between "
                 "turns takes its next turn with the new weights, its environment kept in "
                 f"memory (never asked again; {resume})")
    return what + f"; a trajectory spans at most {cap} update{'s' if cap > 1 else ''}"


__all__ = ["StalenessPolicy", "async_note", "correction_mode", "is_stale", "partial_note",
           "sample_weights", "start_line", "token_lag_metrics"]
