"""Fused GRPO per-token loss from the policy's vocab-parallel logits.

The only expensive part of a GRPO loss is the pass over the vocabulary. It runs once forward and
once backward in the fused log-prob kernel (``logprob.vocab_parallel_logprob``, with entropy
for the metrics). Everything after it is algebra on ``[T]`` vectors - ratio, clipping, KL,
importance weights - written as plain torch elementwise ops: autograd carries their gradient
into the kernel's ``d loss / d logp``, which costs O(T), not O(T * V). No fp32 ``[T, V]`` tensor
exists at any point.

Per valid token (``mask`` True), with ``A`` the advantage and ``r`` the policy ratio:

- ``ratio_level="token"``: ``r = exp(logp - old_logp)``.
  ``ratio_level="sequence"`` (GSPO): ``r = exp(mean_{valid t in seq} (logp_t - old_logp_t))``,
  the same value for every token of a sequence, differentiable through every token's logp.
- ``policy_loss="ppo"``: ``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``; with dual clip
  (``dual_clip_c = c > 1``, Ye et al. 2020, arXiv:1912.09729) tokens with ``A < 0`` are capped
  at ``-c A``: the objective ``max(min(r A, clip(r) A), c A)``, i.e. the loss
  ``min(ppo_loss, c |A|)``.
- ``policy_loss="cispo"`` (MiniMax-M1, arXiv:2506.13585): ``-sg(min(r, 1 + eps_high)) A logp``.
- rollout importance weight (``is_weight``, e.g. pi_train/pi_rollout of the old policy),
  truncated at ``is_cap``, multiplies the policy term (no gradient through it).
- KL to the reference, added as ``beta * kl``: with ``d = clamp(logp - ref_logp, -c_in, c_in)``,
  k1 ``d``, k2 ``d^2 / 2``, k3 ``exp(-d) + d - 1`` (Schulman's estimators), then clamped to
  ``[-c_out, c_out]``, ``(c_in, c_out) = kl_clamp``. A clamp zeroes the KL gradient wherever it
  is active, so each estimator has its own default (``KL_CLAMPS``): k3 is clamped (20, 10)
  because ``exp(-d)`` overflows fp32 beyond d < -88 and grows without bound; k1 (linear) and k2
  (quadratic) cannot overflow and are not clamped. The trainer's KL-in-reward path calls
  ``kl_penalty`` with the same clamp as the loss.

Masked tokens get loss 0 and no gradient. The trainer aggregates the per-token losses.
"""
from __future__ import annotations

import torch

from .logprob import vocab_parallel_logprob

KL_ESTIMATORS = ("k1", "k2", "k3")
POLICY_LOSSES = ("ppo", "cispo")
RATIO_LEVELS = ("token", "sequence")
KL_CLAMPS: dict[str, tuple[float, float] | None] = {"k1": None, "k2": None, "k3": (20.0, 10.0)}
"""Default (input, output) clamp per estimator (None = unclamped); see the module docstring."""


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3",
               clamp: tuple[float, float] | None = None) -> torch.Tensor:
    """Per-token KL(policy || ref) estimate ``[T]`` from log-probs of the sampled tokens ``[T]``.

    ``clamp`` (input, output): ``d = logp - ref_logp`` is clamped to ``[-input, input]`` and the
    estimate to ``[-output, output]`` (``inf`` = that side unclamped); None = the estimator's
    default from ``KL_CLAMPS`` (k3 (20, 10); k1 and k2 unclamped).
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    clamp = KL_CLAMPS[estimator] if clamp is None else clamp
    d = logp - ref_logp
    if clamp is not None:
        d = d.clamp(-clamp[0], clamp[0])
    if estimator == "k1":
        kl = d
    elif estimator == "k2":
        kl = 0.5 * d * d
    else:
        kl = torch.exp(-d) + d - 1.0
    return kl if clamp is None else kl.clamp(-clamp[1], clamp[1])


def sequence_mean(values: torch.Tensor, seq_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over each sequence's valid tokens, broadcast back to ``[T]``.

    ``seq_ids`` ``[T]`` holds integers in ``[0, T)``; the buffers are sized T so no host sync
    is needed to learn the number of sequences.
    """
    n = values.shape[0]
    ids = seq_ids.to(values.device, torch.long)
    weight = mask.to(values.dtype)
    sums = values.new_zeros(n).index_add(0, ids, values * weight)
    counts = values.new_zeros(n).index_add(0, ids, weight).clamp_min(1.0)
    return (sums / counts)[ids]


def _check_options(policy_loss, beta, ref_logp, dual_clip_c, ratio_level, seq_ids,
                   kl_estimator) -> None:
    """Reject bad option combinations before any vocab pass runs."""
    if policy_loss not in POLICY_LOSSES:
        raise ValueError(f"policy_loss must be one of {POLICY_LOSSES}, got {policy_loss!r}")
    if beta != 0.0 and ref_logp is None:
        raise ValueError("beta != 0 needs ref_logp")
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got {ratio_level!r}")
    if ratio_level == "sequence" and seq_ids is None:
        raise ValueError("ratio_level='sequence' needs seq_ids [T]")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}")


def _policy_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, ratio_level: str,
                  seq_ids: torch.Tensor | None) -> torch.Tensor:
    if ratio_level == "sequence":
        log_ratio = sequence_mean(log_ratio, seq_ids, mask)
    return torch.exp(log_ratio)


def grpo_token_loss(
    logits: torch.Tensor,
    target: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ref_logp: torch.Tensor | None = None,
    group=None,
    temperature: float = 1.0,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip_c: float | None = None,
    beta: float = 0.0,
    kl_estimator: str = "k3",
    kl_clamp: tuple[float, float] | None = None,
    ratio_level: str = "token",
    seq_ids: torch.Tensor | None = None,
    is_weight: torch.Tensor | None = None,
    is_cap: float | None = None,
    policy_loss: str = "ppo",
    impl: str = "auto",
    inplace_backward: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token GRPO loss ``[T]`` fp32 (0 where ``mask`` is False) and per-token metrics.

    Args:
        logits: ``[T, V_local]`` policy logits, this rank's vocab slice (as in
            ``vocab_parallel_logprob``).
        target: ``[T]`` int64 sampled token ids (global vocab ids).
        old_logp: ``[T]`` log-probs under the behaviour/old policy (no grad); None = on-policy
            (``logp.detach()``: ratio 1, gradient of the plain policy-gradient term).
        advantages: ``[T]`` per-token advantages (broadcast per sequence by the caller).
        mask: ``[T]`` bool, True = token counts (response tokens).
        ref_logp: ``[T]`` reference log-probs; needed when ``beta != 0``.
        group: tensor-parallel process group (None for TP=1).
        temperature: sampling temperature (logits are divided by it).
        eps_low, eps_high: PPO clip range ``[1 - eps_low, 1 + eps_high]`` (CISPO uses eps_high).
        dual_clip_c: dual-clip constant c > 1 for A < 0, or None.
        beta: KL coefficient; kl_estimator: "k1" | "k2" | "k3"; kl_clamp: (input, output) clamp
            of ``kl_penalty`` (None = the estimator's default, ``KL_CLAMPS``).
        ratio_level: "token" (GRPO/PPO) or "sequence" (GSPO; needs ``seq_ids`` ``[T]``).
        is_weight: ``[T]`` rollout importance weights, truncated at ``is_cap`` when given.
        policy_loss: "ppo" or "cispo".
        impl: "auto" | "triton" | "torch" for the vocab pass.
        inplace_backward: let the backward overwrite ``logits`` with its gradient.

    Returns:
        ``(loss [T] fp32, metrics)``; metrics hold detached ``[T]`` tensors ``logp``, ``kl``
        (zeros without ``ref_logp``), ``ratio``, ``entropy`` and bool ``clipped_low``,
        ``clipped_high``, ``clipped_dual``.
    """
    _check_options(policy_loss, beta, ref_logp, dual_clip_c, ratio_level, seq_ids, kl_estimator)
    logp, entropy = vocab_parallel_logprob(
        logits, target, temperature=temperature, group=group, ignore_mask=~mask.bool(),
        with_entropy=True, inplace_backward=inplace_backward, impl=impl,
    )
    return grpo_loss_from_logp(
        logp, old_logp, advantages, mask, entropy=entropy, ref_logp=ref_logp, eps_low=eps_low,
        eps_high=eps_high, dual_clip_c=dual_clip_c, beta=beta, kl_estimator=kl_estimator,
        kl_clamp=kl_clamp, ratio_level=ratio_level, seq_ids=seq_ids, is_weight=is_weight,
        is_cap=is_cap, policy_loss=policy_loss,
    )


def grpo_loss_from_logp(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    entropy: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip_c: float | None = None,
    beta: float = 0.0,
    kl_estimator: str = "k3",
    kl_clamp: tuple[float, float] | None = None,
    ratio_level: str = "token",
    seq_ids: torch.Tensor | None = None,
    is_weight: torch.Tensor | None = None,
    is_cap: float | None = None,
    policy_loss: str = "ppo",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The ``[T]`` algebra of ``grpo_token_loss`` given differentiable ``logp`` ``[T]``.

    Same arguments and return value as ``grpo_token_loss`` (``entropy`` only feeds the metrics;
    zeros when None). Useful when the log-probs come from elsewhere (e.g. the naive baseline).
    """
    _check_options(policy_loss, beta, ref_logp, dual_clip_c, ratio_level, seq_ids, kl_estimator)
    dev = logp.device
    mask = mask.to(dev, torch.bool)
    logp = logp.float()
    entropy = torch.zeros_like(logp) if entropy is None else entropy
    # Zero every input at masked positions first: garbage there (inf, NaN) must not reach the
    # gradient through 0 * inf.
    zero = logp.new_zeros(())
    adv = torch.where(mask, advantages.to(dev, torch.float32), zero)
    # old_logp None = on-policy (one pass, one optimizer step): ratio is 1 with the gradient of
    # exp(logp - sg(logp)), which saves the trainer a forward pass for the old log-probs.
    old = logp.detach() if old_logp is None else old_logp.to(dev, torch.float32)
    log_ratio = torch.where(mask, logp - old, zero)
    ratio = _policy_ratio(log_ratio, mask, ratio_level, seq_ids)

    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    clipped_low = mask & (ratio < lo) & (adv < 0)
    clipped_high = mask & (ratio > hi) & (adv > 0)
    clipped_dual = torch.zeros_like(mask)
    if policy_loss == "ppo":
        pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(lo, hi))
        if dual_clip_c is not None:
            cap = -dual_clip_c * adv  # = c |A| where A < 0
            clipped_dual = mask & (adv < 0) & (pg > cap)
            pg = torch.where(adv < 0, torch.minimum(pg, cap), pg)
    else:
        clipped_low = torch.zeros_like(mask)
        clipped_high = mask & (ratio > hi)
        pg = -ratio.clamp(max=hi).detach() * adv * logp

    if is_weight is not None:
        w = torch.where(mask, is_weight.to(dev, torch.float32), zero).detach()
        pg = pg * (w.clamp(max=is_cap) if is_cap is not None else w)

    kl = torch.zeros_like(logp)
    if ref_logp is not None:
        ref = torch.where(mask, ref_logp.to(dev, torch.float32), zero)
        kl = kl_penalty(torch.where(mask, logp, zero), ref, kl_estimator, kl_clamp)
    loss = pg + beta * kl if beta != 0.0 else pg
    loss = torch.where(mask, loss, zero)
    metrics = {
        "logp": logp.detach(), "kl": kl.detach(), "ratio": ratio.detach(),
        "entropy": entropy.detach(), "clipped_low": clipped_low, "clipped_high": clipped_high,
        "clipped_dual": clipped_dual,
    }
    return loss, metrics
