"""The GRPO per-token loss: its options (``LossSpec``), its per-token inputs (``TokenInputs``)
and its ``[T]`` algebra (``loss_from_logp``).

The only expensive part of a GRPO loss is the pass over the vocabulary. It runs once forward and
once backward in the fused log-prob kernel (``logprob.vocab_parallel_logprob``, with entropy
for the metrics) or the fused output layer (``fused_output``). Everything after it is algebra on
``[T]`` vectors - ratio, policy term, KL, importance weights - written as plain torch
elementwise ops: autograd carries their gradient into the kernel's ``d loss / d logp``, which
costs O(T), not O(T * V). The public ops taking logits or hidden states are in ``ops``.

Per valid token (``mask`` True), with ``A`` the advantage and ``r`` the policy ratio:

- ``ratio_level="token"``: ``r = exp(logp - old_logp)``.
  ``ratio_level="sequence"`` (GSPO): ``r = exp(mean_{valid t in seq} (logp_t - old_logp_t))``,
  the same value for every token of a sequence, differentiable through every token's logp.
  Under context parallelism (``TokenInputs.seq_split``) a sequence's tokens lie on several
  ranks: the mean's sums and counts are all-reduced over their group (``SequenceSplit``).
- the policy term, one function per ``policy_loss`` (``POLICY_TERMS``):
  ``"ppo"``: ``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``; with dual clip
  (``dual_clip_c = c > 1``, Ye et al. 2020, arXiv:1912.09729) tokens with ``A < 0`` are capped
  at ``-c A``: the objective ``max(min(r A, clip(r) A), c A)``, i.e. the loss
  ``min(ppo_loss, c |A|)``.
  ``"cispo"`` (MiniMax-M1, arXiv:2506.13585): ``-sg(min(r, 1 + eps_high)) A logp``.
  ``"sapo"`` (SAPO, Gao et al. 2025, arXiv:2511.20347): ``-f(r) A`` with the soft gate
  ``f(r) = sigmoid(tau (r - 1)) 4 / tau`` instead of the hard clip (``_sapo``).
- rollout importance weight (``is_weight``, e.g. pi_train/pi_rollout of the old policy),
  truncated at ``is_cap``, multiplies the token's whole loss, the policy term and the KL term
  (no gradient through it): the tokens were sampled by the rollout policy, and the weight
  turns an expectation over its samples into one over the old policy's for either term
  (without it the KL term's expected gradient on a stale batch is the behaviour policy's:
  15-29% off at a total variation of 0.04 between the two, 1.2-2.3x off at 0.31 on
  tests/test_offpolicy_kl.py's bandit).
- KL to the reference, added as ``beta * kl``, one function per ``kl_estimator``
  (``KL_TERMS``): with ``d = clamp(logp - ref_logp, -c_in, c_in)``, k1 ``d``, k2 ``d^2 / 2``,
  k3 ``exp(-d) + d - 1`` (Schulman's estimators; computed as ``expm1(-d) + d``), k3_is
  ``r_t * k3`` (DeepSeek-V3.2's bias-corrected k3, ``_k3_is``), then clamped to
  ``[-c_out, c_out]``, ``(c_in, c_out) = kl_clamp``. A clamp zeroes the KL gradient wherever
  it is active, so each estimator has its own default (``KL_CLAMPS``): k3 and k3_is are
  clamped (20, 10) because ``exp(-d)`` overflows fp32 beyond d < -88 and grows without bound;
  k1 (linear) and k2 (quadratic) cannot overflow and are not clamped. The trainer's
  KL-in-reward path calls ``kl_penalty`` with the same clamp as the loss (and no ratio: k3_is
  is k3 there).

Masked tokens get loss 0 and no gradient. The trainer aggregates the per-token losses.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from .dispatch import VocabPass

RATIO_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class SequenceSplit:
    """Context parallelism: every sequence's tokens are spread over the ranks of ``group``
    (each holds some of each sequence, rows ``[0, num_seqs)`` alike on every rank)."""

    group: object
    """The process group the sequences are split over."""
    num_seqs: int
    """Sequences (rows) on every rank: ``seq_ids`` lie in ``[0, num_seqs)``."""


class TokenInputs(NamedTuple):
    """The per-token ``[T]`` inputs of the loss besides the log-probs (and the targets)."""

    old_logp: Tensor | None
    """Log-probs under the behaviour/old policy (no grad); None = on-policy (``logp.detach()``:
    ratio 1, the gradient of the plain policy-gradient term)."""
    advantages: Tensor
    """Per-token advantages (broadcast per sequence by the caller)."""
    mask: Tensor
    """bool, True = the token counts (response tokens)."""
    ref_logp: Tensor | None = None
    """Reference log-probs; needed when ``beta != 0``."""
    is_weight: Tensor | None = None
    """Rollout importance weights (truncated at ``LossSpec.is_cap`` when that is set)."""
    seq_ids: Tensor | None = None
    """int, each token's sequence in ``[0, T)``; needed by ``ratio_level="sequence"``."""
    seq_split: SequenceSplit | None = None
    """The sequences continue on other ranks (context parallelism): GSPO's sequence mean
    reduces over them. None: every sequence is whole here."""

    def rows(self, rows: slice) -> TokenInputs:
        """The inputs of the tokens ``rows`` (views)."""
        return TokenInputs(*(x[rows] if isinstance(x, Tensor) else x for x in self))


# ------------------------------------------------------------------------------ policy terms
PolicyTerm = Callable[[Tensor, Tensor, Tensor, "LossSpec"], tuple[Tensor, ...]]
"""``(ratio, adv, logp, spec) -> (loss, clipped_low, clipped_high, clipped_dual)``, all ``[T]``
(the flags bool; the caller masks them)."""


def _ppo(ratio: Tensor, adv: Tensor, logp: Tensor, spec: LossSpec) -> tuple[Tensor, ...]:
    """PPO's clipped surrogate, with the optional dual clip (module docstring)."""
    lo, hi = 1.0 - spec.eps_low, 1.0 + spec.eps_high
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(lo, hi))
    dual = torch.zeros_like(adv, dtype=torch.bool)
    if spec.dual_clip_c is not None:
        cap = -spec.dual_clip_c * adv  # = c |A| where A < 0
        dual = (adv < 0) & (pg > cap)
        pg = torch.where(adv < 0, torch.minimum(pg, cap), pg)
    return pg, (ratio < lo) & (adv < 0), (ratio > hi) & (adv > 0), dual


def _cispo(ratio: Tensor, adv: Tensor, logp: Tensor, spec: LossSpec) -> tuple[Tensor, ...]:
    """CISPO: REINFORCE weighted by the truncated, stop-gradient ratio (clips no token out)."""
    hi = 1.0 + spec.eps_high
    none = torch.zeros_like(adv, dtype=torch.bool)
    return -ratio.clamp(max=hi).detach() * adv * logp, none, ratio > hi, none


def _sapo(ratio: Tensor, adv: Tensor, logp: Tensor, spec: LossSpec) -> tuple[Tensor, ...]:
    """SAPO (Soft Adaptive Policy Optimization, Gao et al., Qwen 2025, arXiv:2511.20347): the
    hard clip replaced by a smooth gate of the ratio, ``loss = -f(r) A`` with
    ``f(r) = sigmoid(tau (r - 1)) * 4 / tau``, ``tau = tau_pos`` where ``A > 0``, else
    ``tau_neg``. Its gradient ``-A 4 s (1 - s) r dlogp`` (``s = sigmoid(tau (r - 1))``) is the
    plain policy gradient at ``r = 1`` (``4 s (1 - s) = 1``) and decays smoothly as ``r``
    leaves 1, faster for the larger temperature (the paper takes ``tau_neg > tau_pos``). No
    token is clipped: the flags stay False."""
    tau = torch.where(adv > 0, spec.sapo_tau_pos, spec.sapo_tau_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    none = torch.zeros_like(adv, dtype=torch.bool)
    return -gate * adv, none, none, none


POLICY_TERMS: dict[str, PolicyTerm] = {"ppo": _ppo, "cispo": _cispo, "sapo": _sapo}
"""The policy term of each ``LossSpec.policy_loss``: a new loss type is one function here."""


# ------------------------------------------------------------------------------ KL estimators
def _k1(d: Tensor, ratio: Tensor | None) -> Tensor:
    return d


def _k2(d: Tensor, ratio: Tensor | None) -> Tensor:
    return 0.5 * d * d


def _k3(d: Tensor, ratio: Tensor | None) -> Tensor:
    # exp(-d) - 1 as expm1: for tiny d, exp(-d) + d - 1 ~ d^2 / 2 would cancel to fp32's
    # rounding of 1 (6e-8, against 5e-9 at d = 1e-4); expm1 keeps the error at d's own size
    return torch.expm1(-d) + d


def _k3_is(d: Tensor, ratio: Tensor | None) -> Tensor:
    """DeepSeek-V3.2's bias-corrected k3 (arXiv:2512.02556, Sec. 3.1 "Unbiased KL Estimate"):
    ``(pi_theta / pi_old) (pi_ref / pi_theta - log(pi_ref / pi_theta) - 1)``, i.e. k3 times the
    token's importance ratio ``r_t = exp(logp - old_logp)``, with its gradient: the samples come
    from pi_old, and ``E_old[grad(r_t k3)] = E_theta[grad(logp) (logp - ref_logp)]``, the
    gradient of KL(pi_theta || pi_ref), which k3's own gradient is not. Always the token ratio
    (also under GSPO's sequence-level policy ratio); ``ratio`` None (the KL-in-reward path,
    where pi_theta is pi_old) = 1."""
    return _k3(d, None) if ratio is None else ratio * _k3(d, None)


KL_TERMS: dict[str, Callable[[Tensor, Tensor | None], Tensor]] = {
    "k1": _k1, "k2": _k2, "k3": _k3, "k3_is": _k3_is}
"""``(d = logp - ref_logp clamped, token ratio or None) -> [T]`` of each ``kl_estimator``."""
KL_ESTIMATORS = tuple(KL_TERMS)
KL_CLAMPS: dict[str, tuple[float, float] | None] = {
    "k1": None, "k2": None, "k3": (20.0, 10.0), "k3_is": (20.0, 10.0)}
"""Default (input, output) clamp per estimator (None = unclamped); see the module docstring."""
POLICY_LOSSES = tuple(POLICY_TERMS)


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str = "k3",
               clamp: tuple[float, float] | None = None, ratio: Tensor | None = None) -> Tensor:
    """Per-token KL(policy || ref) estimate ``[T]`` from log-probs of the sampled tokens ``[T]``.

    ``clamp`` (input, output): ``d = logp - ref_logp`` is clamped to ``[-input, input]`` and the
    estimate to ``[-output, output]`` (``inf`` = that side unclamped); None = the estimator's
    default from ``KL_CLAMPS`` (k3, k3_is (20, 10); k1 and k2 unclamped). ``ratio`` ``[T]``:
    the token importance ratio pi_theta / pi_old that k3_is weights by (None = 1).
    """
    if estimator not in KL_TERMS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    clamp = KL_CLAMPS[estimator] if clamp is None else clamp
    d = logp - ref_logp
    if clamp is not None:
        d = d.clamp(-clamp[0], clamp[0])
    kl = KL_TERMS[estimator](d, ratio)
    return kl if clamp is None else kl.clamp(-clamp[1], clamp[1])


# ------------------------------------------------------------------------------ the spec
def _check_number(name: str, value: float | None, low: float = 0.0, *, strict: bool = True,
                  optional: bool = False) -> None:
    """Raise ValueError naming ``LossSpec.<name>`` unless ``value`` is a number > ``low``
    (>= with ``strict`` False; None allowed with ``optional``)."""
    if value is None and optional:
        return
    ok = isinstance(value, (int, float)) and (value > low if strict else value >= low)
    if not ok:  # also NaN and non-numbers
        rel = ">" if strict else ">="
        extra = " or None" if optional else ""
        raise ValueError(f"LossSpec.{name}={value!r}: need a number {rel} {low}{extra}")


@dataclass(frozen=True, kw_only=True)
class LossSpec:
    """The options of the GRPO per-token loss: built once (megagrpo builds it from the algo
    config) and checked once, here; every op and every micro-batch reuses it."""

    policy_loss: str = "ppo"
    """The policy term: "ppo", "cispo" or "sapo" (``POLICY_TERMS``)."""
    eps_low: float = 0.2
    """PPO clip range ``[1 - eps_low, 1 + eps_high]``."""
    eps_high: float = 0.2
    """Upper clip (PPO) / truncation ``1 + eps_high`` of CISPO's stop-gradient weight."""
    dual_clip_c: float | None = None
    """Dual-clip constant c > 1 for A < 0 (PPO), or None."""
    ratio_level: str = "token"
    """"token" (GRPO/PPO) or "sequence" (GSPO; needs ``TokenInputs.seq_ids``)."""
    beta: float = 0.0
    """KL coefficient (>= 0; != 0 needs ``TokenInputs.ref_logp``)."""
    kl_estimator: str = "k3"
    """"k1", "k2", "k3" or "k3_is" (``KL_TERMS``)."""
    kl_clamp: tuple[float, float] | None = None
    """(input, output) clamp of ``kl_penalty``; None = the estimator's default (``KL_CLAMPS``)."""
    is_cap: float | None = None
    """Truncation of ``TokenInputs.is_weight`` (None = none)."""
    sapo_tau_pos: float = 1.0
    """SAPO gate temperature where A > 0 (the paper's default 1.0)."""
    sapo_tau_neg: float = 1.05
    """SAPO gate temperature where A <= 0 (the paper's default 1.05)."""
    temperature: float = 1.0
    """Sampling temperature: logits are divided by it."""

    def __post_init__(self) -> None:
        for name, allowed in (("policy_loss", POLICY_LOSSES), ("ratio_level", RATIO_LEVELS),
                              ("kl_estimator", KL_ESTIMATORS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"LossSpec.{name}={getattr(self, name)!r}: use one of {allowed}")
        _check_number("eps_low", self.eps_low, strict=False)
        _check_number("eps_high", self.eps_high, strict=False)
        _check_number("beta", self.beta, strict=False)
        _check_number("dual_clip_c", self.dual_clip_c, 1.0, optional=True)
        _check_number("is_cap", self.is_cap, optional=True)
        for name in ("sapo_tau_pos", "sapo_tau_neg", "temperature"):
            _check_number(name, getattr(self, name))
        c = self.kl_clamp
        if c is not None and not (len(c) == 2 and all(isinstance(x, (int, float)) and x > 0
                                                      and not math.isnan(x) for x in c)):
            raise ValueError(f"LossSpec.kl_clamp={c!r}: need None or (input, output), both > 0 "
                             "(inf = that side off)")

    @property
    def token_separable(self) -> bool:
        """Each token's loss depends on its own log-prob only (not GSPO's sequence ratio)."""
        return self.ratio_level == "token"

    def check(self, inputs: TokenInputs) -> None:
        """Raise ValueError where ``inputs`` lack what this spec needs (once per op call)."""
        if self.beta != 0.0 and inputs.ref_logp is None:
            raise ValueError(f"LossSpec.beta={self.beta} != 0 needs TokenInputs.ref_logp")
        if self.ratio_level == "sequence" and inputs.seq_ids is None:
            raise ValueError("LossSpec.ratio_level='sequence' needs TokenInputs.seq_ids [T]")


# ------------------------------------------------------------------------------ the algebra
class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) over a group. Backward all-reduces the gradient too: every rank's
    loss depends on the sum, so a rank's own summand gets the gradient of all of them."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sequence_mean(values: Tensor, seq_ids: Tensor, mask: Tensor,
                  split: SequenceSplit | None = None) -> Tensor:
    """Mean of ``values`` over each sequence's valid tokens, broadcast back to ``[T]``.

    ``seq_ids`` ``[T]`` holds integers in ``[0, T)``; the buffers are sized T so no host sync
    is needed to learn the number of sequences. With ``split`` the sequences continue on the
    other ranks of ``split.group``: sums and counts ``[num_seqs]`` are all-reduced over it (a
    collective every rank of the group runs).
    """
    n = values.shape[0] if split is None else split.num_seqs
    ids = seq_ids.to(values.device, torch.long)
    weight = mask.to(values.dtype)
    sums = values.new_zeros(n).index_add(0, ids, values * weight)
    counts = values.new_zeros(n).index_add(0, ids, weight)
    if split is not None:
        sums = _SumOverGroup.apply(sums, split.group)
        dist.all_reduce(counts, group=split.group)
    return (sums / counts.clamp_min(1.0))[ids]


def loss_from_logp(spec: LossSpec, inputs: TokenInputs, logp: Tensor,
                   entropy: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token loss ``[T]`` fp32 (0 where ``mask`` is False) and per-token metrics, from
    differentiable ``logp`` ``[T]`` (``entropy`` ``[T]`` only feeds the metrics; zeros when
    None). ``inputs`` must satisfy ``spec.check`` (the ops check once per call, not per chunk).

    Returns:
        ``(loss [T] fp32, metrics)``; metrics hold detached ``[T]`` tensors ``logp``, ``kl``
        (zeros without ``ref_logp``), ``ratio``, ``entropy`` and bool ``clipped_low``,
        ``clipped_high``, ``clipped_dual``.
    """
    dev = logp.device
    mask = inputs.mask.to(dev, torch.bool)
    logp = logp.float()
    entropy = torch.zeros_like(logp) if entropy is None else entropy
    # Zero every input at masked positions first: garbage there (inf, NaN) must not reach the
    # gradient through 0 * inf.
    zero = logp.new_zeros(())
    adv = torch.where(mask, inputs.advantages.to(dev, torch.float32), zero)
    # old_logp None = on-policy (one pass, one optimizer step): ratio is 1 with the gradient of
    # exp(logp - sg(logp)), which saves the trainer a forward pass for the old log-probs.
    old = logp.detach() if inputs.old_logp is None else inputs.old_logp.to(dev, torch.float32)
    log_ratio = torch.where(mask, logp - old, zero)
    token_ratio = torch.exp(log_ratio)
    ratio = token_ratio
    if spec.ratio_level == "sequence":
        ratio = torch.exp(sequence_mean(log_ratio, inputs.seq_ids, mask, inputs.seq_split))
    pg, low, high, dual = POLICY_TERMS[spec.policy_loss](ratio, adv, logp, spec)
    kl = torch.zeros_like(logp)
    if inputs.ref_logp is not None:
        ref = torch.where(mask, inputs.ref_logp.to(dev, torch.float32), zero)
        kl = kl_penalty(torch.where(mask, logp, zero), ref, spec.kl_estimator, spec.kl_clamp,
                        ratio=token_ratio)
    loss = pg + spec.beta * kl if spec.beta != 0.0 else pg
    if inputs.is_weight is not None:
        # the whole token loss, KL included: its samples come from the behaviour policy too,
        # and only the weighted sum has pi_old's expectation (module docstring)
        w = torch.where(mask, inputs.is_weight.to(dev, torch.float32), zero).detach()
        loss = loss * (w.clamp(max=spec.is_cap) if spec.is_cap is not None else w)
    loss = torch.where(mask, loss, zero)
    metrics = {
        "logp": logp.detach(), "kl": kl.detach(), "ratio": ratio.detach(),
        "entropy": entropy.detach(), "clipped_low": low & mask, "clipped_high": high & mask,
        "clipped_dual": dual & mask,
    }
    return loss, metrics


def from_keywords(old_logp: Tensor | None, advantages: Tensor, mask: Tensor, keywords: dict
                  ) -> tuple[LossSpec, TokenInputs, VocabPass]:
    """The loose-keyword form of the loss functions (their old signatures, kept as thin
    wrappers for tests and scripts): ``keywords`` holds ``TokenInputs``' optional tensors,
    ``LossSpec``'s fields and ``VocabPass``'s; an unknown name raises TypeError."""
    kw = dict(keywords)
    optional = {k: kw.pop(k) for k in ("ref_logp", "is_weight", "seq_ids") if k in kw}
    spec = LossSpec(**{k: kw.pop(k) for k in list(kw) if k in LossSpec.__dataclass_fields__})
    return spec, TokenInputs(old_logp, advantages, mask, **optional), VocabPass(**kw)
