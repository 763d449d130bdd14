"""GRPO algorithm settings: advantages, the clipped objective, KL, loss aggregation, DAPO tricks
and rollout importance-sampling correction. Consumed by `megagrpo.algo` and the fused loss."""
from __future__ import annotations

from dataclasses import dataclass

from megagrpo.config.section import Section

STD_MODES = ("group", "batch", "none")
LOSS_AGGS = ("grpo", "bnpo", "dr_grpo", "dapo", "gspo", "cispo")
KL_ESTIMATORS = ("k1", "k2", "k3", "k3_is")
POLICY_LOSSES = ("ppo", "sapo")
ROLLOUT_IS_MODES = ("none", "truncate", "token_mask", "seq_mask")


@dataclass(kw_only=True)
class AlgoConfig(Section):
    """Iterative GRPO (DeepSeekMath Algorithm 1) plus the common DAPO / Dr. GRPO variants."""

    group_size: int = 8
    """G: completions sampled per prompt (the group of the group-relative baseline)."""
    std_mode: str = "group"
    """Advantage scale: 'group' std (GRPO), 'batch' std, or 'none' (Dr. GRPO: mean-centred only)."""
    std_eps: float = 1e-6
    """Added to the std before dividing, so all-equal groups give zero advantage, not NaN
    (must be > 0)."""
    loss_agg: str = "grpo"
    """Token-loss aggregation: grpo, bnpo, dr_grpo, dapo, gspo or cispo (see megagrpo.algo)."""
    dr_grpo_max_len: int = 0
    """Dr. GRPO constant normaliser (tokens per sequence); 0 = the most model tokens a sample
    can hold: rollout.max_tokens, or in multi-turn runs the trajectory's budget
    (agent.max_total_tokens, or rollout.max_model_len when that is 0)."""
    mu: int = 1
    """Optimisation passes over each batch of rollouts (mu > 1 needs old log-probs)."""
    num_minibatches: int = 1
    """Optimizer steps per pass over a rollout batch (PPO-style minibatches)."""
    eps_low: float = 0.2
    """Lower clip: the ratio is clipped at 1 - eps_low."""
    eps_high: float = 0.2
    """Upper clip: the ratio is clipped at 1 + eps_high (DAPO clip-higher uses e.g. 0.28)."""
    dual_clip_c: float = 0.0
    """Dual-clip bound c (> 1) on the loss of negative-advantage tokens; 0 disables it."""
    cispo_eps_high: float = 5.0
    """CISPO: upper truncation of the stop-gradient IS weight (1 + cispo_eps_high)."""
    policy_loss: str = "ppo"
    """Per-token policy term: 'ppo' (the clipped ratio above; CISPO's own term under
    loss_agg=cispo) or 'sapo' (SAPO, arXiv:2511.20347: a soft sigmoid gate of the token ratio
    instead of the hard clip; not with loss_agg gspo or cispo)."""
    sapo_tau_pos: float = 1.0
    """SAPO gate temperature for tokens with a positive advantage (> 0; the paper's 1.0)."""
    sapo_tau_neg: float = 1.05
    """SAPO gate temperature for the others (> 0; the paper's 1.05: a larger one decays the
    gradient of off-policy tokens faster)."""
    beta: float = 0.04
    """KL coefficient towards the reference model; 0 disables the reference entirely."""
    kl_estimator: str = "k3"
    """Per-token KL estimator: k1 (log-ratio), k2 (squared/2), k3 (Schulman's unbiased, >= 0) or
    k3_is (DeepSeek-V3.2: k3 times the token ratio pi/pi_old, whose gradient is the reverse-KL
    gradient; k3 in the KL-in-reward path, where pi is pi_old)."""
    kl_clamp_input: float = 20.0
    """k3, k3_is: logp - ref_logp is clamped to +-this before exp(); k1/k2 never clamp; 0 = off."""
    kl_clamp_output: float = 10.0
    """k3, k3_is: cap on each token's KL estimate (loss and KL-in-reward alike); 0 = off. verl's
    default 10 is reached at logp - ref_logp ~ -2.6, and from there on the token's KL gradient is
    0, exactly where the policy has drifted furthest below the reference: raise it (or 0) to
    keep pulling there."""
    kl_in_reward: bool = False
    """Subtract beta * summed token KL (old policy vs reference) from rewards before advantages."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and top up by sampling more prompts."""
    max_resample_rounds: int = 4
    """Dynamic sampling: most extra generation rounds per step before training on what is kept."""
    overlong_buffer: int = 0
    """DAPO soft overlong punishment: length of the penalty ramp before max length
    (rollout.max_tokens; multi-turn: every token after the prompt against the trajectory's
    budget, agent.max_total_tokens); 0 = off."""
    overlong_penalty: float = 1.0
    """Reward penalty at max length (linear from 0 at max_len - overlong_buffer)."""
    mask_truncated: bool = False
    """Exclude completions that hit max length without EOS from the loss (DAPO overlong filter;
    multi-turn: trajectories cut by a turn's length, agent.max_turns or the token budget)."""
    max_abs_reward: float = 1e6
    """A non-finite reward, or one with |reward| > this, skips the step's update; 0 = no bound."""
    rollout_is: str = "none"
    """vLLM-vs-trainer mismatch correction: none, truncate (TIS), token_mask or seq_mask. A
    stale batch (async: sampled one update behind) trains with truncate under none: the
    decoupled objective (megagrpo.train.offpolicy)."""
    rollout_is_cap: float = 2.0
    """truncate (and stale batches under none): per-token weight
    min(exp(logp_old - logp_vllm), cap)."""
    rollout_is_low: float = 0.5
    """token_mask/seq_mask: ratios below this are masked (seq_mask: per-sequence geometric mean)."""
    rollout_is_high: float = 2.0
    """token_mask/seq_mask: ratios above this are masked."""
    routing_replay: bool = False
    """MoE: the trainer's forwards (update and the policy's scoring) route every token to the
    experts vLLM chose for it while sampling (rollout routing replay, megatron's RouterReplay);
    the reference routes by itself. Needs an MoE model; colocated, no batch drawn ahead
    (rollout.max_staleness 0); under separate placement the routes come back with the samples
    at any k."""

    def needs_old_logprobs(self, *, async_batch: bool, kl_in_reward: bool) -> bool:
        """Whether a step scores the policy's old log-probs before its updates: several passes
        or minibatches, an off-policy batch, a rollout-IS correction, or the KL folded into the
        reward (`kl_in_reward`: on, with a reference)."""
        return (self.mu > 1 or self.num_minibatches > 1 or async_batch
                or self.rollout_is != "none" or kl_in_reward)

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field and what would be valid."""
        _choice("std_mode", self.std_mode, STD_MODES)
        _choice("loss_agg", self.loss_agg, LOSS_AGGS)
        _choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _choice("rollout_is", self.rollout_is, ROLLOUT_IS_MODES)
        _choice("policy_loss", self.policy_loss, POLICY_LOSSES)
        if self.policy_loss == "sapo" and self.loss_agg in ("gspo", "cispo"):
            raise ValueError(f"algo.policy_loss='sapo' with algo.loss_agg={self.loss_agg!r}: "
                             f"{self.loss_agg} has its own policy term; use grpo, bnpo, dr_grpo "
                             "or dapo")
        for f in ("sapo_tau_pos", "sapo_tau_neg"):
            if not getattr(self, f) > 0.0:  # also rejects NaN
                raise ValueError(f"algo.{f}={getattr(self, f)}: need > 0")
        if self.group_size < 2:
            raise ValueError(f"algo.group_size={self.group_size}: need >= 2 for a group baseline")
        if self.mu < 1:
            raise ValueError(f"algo.mu={self.mu}: need >= 1 optimisation pass")
        if self.num_minibatches < 1:
            raise ValueError(f"algo.num_minibatches={self.num_minibatches} must be >= 1")
        if not 0.0 <= self.eps_low < 1.0:
            raise ValueError(f"algo.eps_low={self.eps_low}: need 0 <= eps_low < 1")
        if self.eps_high < 0.0:
            raise ValueError(f"algo.eps_high={self.eps_high}: need >= 0")
        if self.dual_clip_c != 0.0 and self.dual_clip_c <= 1.0:
            raise ValueError(f"algo.dual_clip_c={self.dual_clip_c}: need 0 (off) or > 1")
        if self.cispo_eps_high < 0.0:
            raise ValueError(f"algo.cispo_eps_high={self.cispo_eps_high}: need >= 0")
        if self.beta < 0.0:
            raise ValueError(f"algo.beta={self.beta}: need >= 0")
        for f in ("kl_clamp_input", "kl_clamp_output", "max_abs_reward"):
            if not getattr(self, f) >= 0.0:  # also rejects NaN
                raise ValueError(f"algo.{f}={getattr(self, f)}: need >= 0 (0 = off)")
        if not self.std_eps > 0.0:  # also rejects NaN
            raise ValueError(f"algo.std_eps={self.std_eps}: need > 0 (with 0 a group whose "
                             "rewards are all equal divides 0 by 0 and every advantage is NaN); "
                             "use e.g. 1e-6")
        if self.dr_grpo_max_len < 0:
            raise ValueError(f"algo.dr_grpo_max_len={self.dr_grpo_max_len}: need >= 0")
        if self.max_resample_rounds < 0:
            raise ValueError(f"algo.max_resample_rounds={self.max_resample_rounds}: need >= 0")
        if self.overlong_buffer < 0 or self.overlong_penalty < 0:
            raise ValueError(
                f"algo.overlong_buffer={self.overlong_buffer}, algo.overlong_penalty="
                f"{self.overlong_penalty}: both need >= 0"
            )
        self._validate_rollout_is()

    def _validate_rollout_is(self) -> None:
        if self.rollout_is_cap < 1.0:
            raise ValueError(f"algo.rollout_is_cap={self.rollout_is_cap}: need >= 1")
        if not 0.0 <= self.rollout_is_low < 1.0 < self.rollout_is_high:
            raise ValueError(
                f"algo.rollout_is_low={self.rollout_is_low}, algo.rollout_is_high="
                f"{self.rollout_is_high}: need 0 <= low < 1 < high"
            )


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"algo.{name}={value!r}: use one of {allowed}")
