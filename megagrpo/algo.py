"""GRPO algorithm pieces as pure functions of tensors (DeepSeekMath arXiv 2402.03300, Alg. 1).

Layout conventions:
- Sequence-level tensors are `[N]` with N = B * G: the G completions of prompt b sit at
  rows b*G .. b*G+G-1 (contiguous groups).
- Token-level tensors are packed `[T]`: every token carries `seq_ids[t]`, the index of its
  sequence within the local chunk (0 .. S-1), and `mask[t]` (1 = counts in the loss). Tokens with
  mask 0 (prompt, padding) may carry any id in range.

The fused loss kernel (megagrpo.kernels) computes the per-token clipped loss; this module turns
per-token losses into a scalar with the right normaliser, and prepares everything around it
(advantages, KL, DAPO shaping, rollout importance sampling, metrics).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

# ---------------------------------------------------------------------------------------------
# packed-layout helpers


def num_sequences(seq_ids: Tensor, num_local_seqs: int | None = None) -> int:
    """S for a packed chunk: `num_local_seqs` if given (avoids a device sync), else max id + 1."""
    if num_local_seqs is not None:
        return num_local_seqs
    return int(seq_ids.max().item()) + 1 if seq_ids.numel() else 0


def per_sequence_sum(values: Tensor, mask: Tensor, seq_ids: Tensor, num_seqs: int) -> Tensor:
    """Sum of `values * mask` per sequence. values, mask, seq_ids: [T] -> [S]."""
    out = torch.zeros(num_seqs, dtype=values.dtype, device=values.device)
    return out.index_add_(0, seq_ids.long(), values * mask.to(values.dtype))


def per_sequence_mean(values: Tensor, mask: Tensor, seq_ids: Tensor, num_seqs: int) -> Tensor:
    """Mean of `values` over each sequence's valid tokens (0 for a sequence with none). -> [S]."""
    total = per_sequence_sum(values, mask, seq_ids, num_seqs)
    count = per_sequence_sum(torch.ones_like(values), mask, seq_ids, num_seqs)
    return total / count.clamp(min=1)


def expand_to_tokens(seq_values: Tensor, seq_ids: Tensor) -> Tensor:
    """Broadcast per-sequence values to their tokens. seq_values: [S], seq_ids: [T] -> [T]."""
    return seq_values[seq_ids.long()]


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of `values` where mask is set (0 if none). values, mask: [T] -> scalar."""
    m = mask.to(values.dtype)
    return (values * m).sum() / m.sum().clamp(min=1)


# ---------------------------------------------------------------------------------------------
# advantages


def group_advantages(
    rewards: Tensor, group_size: int, std_mode: str = "group", eps: float = 1e-6,
    valid: Tensor | None = None,
) -> Tensor:
    """Group-relative advantages (outcome supervision: one value per completion).

    A_i = (r_i - mean(group)) / (std + eps), std being the group's std ('group', GRPO), the std of
    all of `rewards` ('batch'; pass the DP-gathered rewards for a global one) or 1 ('none', Dr.
    GRPO). Stds are unbiased (Bessel), as torch.std. rewards: [B*G] -> [B*G].

    `valid` [B*G] bool: the samples that count (None: all). A dropped sample (its environment
    failed: `Completion.dropped`) takes no part in its group's mean and std nor in the batch std,
    as if the group had been drawn without it; its own advantage is 0. A group with one valid
    sample gets 0 (no baseline to compare it with), as a group of one would.
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    if valid is None:
        grouped = rewards.view(-1, group_size)
        centred = grouped - grouped.mean(dim=1, keepdim=True)
        if std_mode == "group":
            centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
        elif std_mode == "batch":
            centred = centred / (rewards.std() + eps)
        elif std_mode != "none":
            raise ValueError(f"std_mode={std_mode!r}: use 'group', 'batch' or 'none'")
        return centred.reshape(-1)
    keep = valid.view(-1, group_size)
    grouped = torch.where(keep, rewards.view(-1, group_size), 0.0)
    n = keep.sum(dim=1, keepdim=True)
    mean = grouped.sum(dim=1, keepdim=True) / n.clamp(min=1)
    centred = torch.where(keep & (n > 1), grouped - mean, 0.0)
    if std_mode == "group":
        var = (centred ** 2).sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)
        centred = centred / (var.sqrt() + eps)
    elif std_mode == "batch":
        centred = centred / (rewards[valid].std() + eps)
    elif std_mode != "none":
        raise ValueError(f"std_mode={std_mode!r}: use 'group', 'batch' or 'none'")
    return centred.reshape(-1)


# ---------------------------------------------------------------------------------------------
# loss aggregation (a real family of variants: a registry)


@dataclass(frozen=True, kw_only=True)
class LossCounts:
    """Global normalisers for one optimiser step: summed over every micro-batch and DP rank.

    With these, each chunk's aggregated loss is its share of the full-batch loss, so summing
    the chunks (gradient accumulation + DP all-reduce SUM) gives exactly the full-batch value.
    """

    num_tokens: float
    """Valid (mask=1) completion tokens in the whole step."""
    num_seqs: float
    """Real sequences (completions) in the whole step, those without a loss token included (a
    completion masked out by mask_truncated or rollout_is=seq_mask, or an empty one): grpo /
    gspo average over every sequence and dr_grpo divides by their number, as TRL's
    `loss_type="grpo"` (`.mean()` over the batch) and `"dr_grpo"` (`size(0)`) do. Padding rows
    (`Batch.seq_valid` False) are not sequences."""
    max_len: float = 1.0
    """Dr. GRPO constant per-sequence normaliser (e.g. max new tokens)."""
    num_chunks: int = 1
    """Micro-batches x DP ranks of the step (bnpo only: it normalises per chunk)."""
    seq_tokens: Tensor | None = None
    """[S] valid tokens of each of the chunk's sequences where the chunk holds only part of
    them (context parallelism: `megagrpo.parallel.context_parallel.ChunkBatch`); None: the chunk's
    own count."""

    @classmethod
    def from_totals(
        cls, totals: Tensor, *, max_len: float = 1.0, num_chunks: int = 1
    ) -> LossCounts:
        """From the [2] tensor of `local_counts`, summed over micro-batches and all-reduced."""
        num_tokens, num_seqs = (float(v) for v in totals.tolist())
        return cls(num_tokens=num_tokens, num_seqs=num_seqs, max_len=max_len, num_chunks=num_chunks)


AggFn = Callable[[Tensor, Tensor, Tensor, LossCounts, int], Tensor]
LOSS_AGGREGATIONS: dict[str, AggFn] = {}


def register_loss_agg(name: str) -> Callable[[AggFn], AggFn]:
    """Decorator adding an aggregation `fn(token_loss, mask, seq_ids, counts, S) -> scalar`."""

    def add(fn: AggFn) -> AggFn:
        LOSS_AGGREGATIONS[name] = fn
        return fn

    return add


@register_loss_agg("grpo")
@register_loss_agg("gspo")
def _agg_sequence_mean(
    loss: Tensor, mask: Tensor, seq_ids: Tensor, c: LossCounts, s: int
) -> Tensor:
    """Mean over each sequence's valid tokens, then mean over sequences (GRPO paper, Eq. 3).

    GSPO (arXiv 2507.18071) uses it too: its per-token loss already carries the sequence-level
    ratio, so the sequence mean of tokens is its per-sequence objective."""
    if c.seq_tokens is not None:  # a chunk of each sequence: divide by its whole length
        per_seq = per_sequence_sum(loss, mask, seq_ids, s) / c.seq_tokens.to(loss.dtype).clamp(
            min=1)
        return per_seq.sum() / c.num_seqs
    return per_sequence_mean(loss, mask, seq_ids, s).sum() / c.num_seqs


@register_loss_agg("dapo")
@register_loss_agg("cispo")
def _agg_token_mean(loss: Tensor, mask: Tensor, seq_ids: Tensor, c: LossCounts, s: int) -> Tensor:
    """Token-level: sum over valid tokens / valid tokens of the whole step (DAPO, Eq. 8).

    CISPO (MiniMax-M1, arXiv 2506.13585) normalises the same way (by sum of |o_i|)."""
    return (loss * mask.to(loss.dtype)).sum() / max(c.num_tokens, 1.0)


@register_loss_agg("bnpo")
def _agg_chunk_token_mean(
    loss: Tensor, mask: Tensor, seq_ids: Tensor, c: LossCounts, s: int
) -> Tensor:
    """Token mean within this chunk (micro-batch), averaged over chunks (TRL's bnpo).

    Equals 'dapo' when the step is one chunk; otherwise it depends on how tokens fall into
    chunks, by design (that is the difference from dapo)."""
    return masked_mean(loss, mask) / c.num_chunks


@register_loss_agg("dr_grpo")
def _agg_constant(loss: Tensor, mask: Tensor, seq_ids: Tensor, c: LossCounts, s: int) -> Tensor:
    """Sum over valid tokens / (sequences * constant max length) (Dr. GRPO, arXiv 2503.20783)."""
    return (loss * mask.to(loss.dtype)).sum() / (c.num_seqs * c.max_len)


def aggregate_loss(
    token_loss: Tensor,
    mask: Tensor,
    seq_ids: Tensor,
    *,
    mode: str,
    counts: LossCounts,
    num_local_seqs: int | None = None,
) -> Tensor:
    """This chunk's share of the step loss. token_loss, mask, seq_ids: [T] -> scalar.

    `counts` holds the GLOBAL normalisers (see `local_counts`), so chunk losses SUM to the loss
    of the whole step across gradient accumulation and DP ranks. Where the framework averages
    instead (megatron-core's forward_backward_func divides by num_microbatches and its DDP
    averages gradients over DP by default), scale by num_microbatches * dp_size or switch the
    averaging off (calculate_per_token_loss / average_in_collective)."""
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss_agg={mode!r}: use one of {sorted(LOSS_AGGREGATIONS)}")
    s = num_sequences(seq_ids, num_local_seqs)
    return LOSS_AGGREGATIONS[mode](token_loss, mask, seq_ids, counts, s)


def aggregation_weights(
    mask: Tensor,
    seq_ids: Tensor,
    *,
    mode: str,
    counts: LossCounts,
    num_local_seqs: int | None = None,
) -> Tensor:
    """[T] fp32 weights c with `aggregate_loss(l) == (c * l).sum()` for every per-token loss l:
    each registered aggregation is linear in l, so c is its gradient (what a fused loss that
    computes its gradient in the forward needs up front). Checked on a random l (O(T)), so a
    non-linear aggregation fails loudly instead of training on a wrong gradient."""
    probe = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device, requires_grad=True)
    with torch.enable_grad():
        agg = aggregate_loss(probe, mask, seq_ids, mode=mode, counts=counts,
                             num_local_seqs=num_local_seqs)
        (c,) = torch.autograd.grad(agg, probe, allow_unused=True, materialize_grads=True)
    test = torch.rand(mask.shape, dtype=torch.float64, device=mask.device)
    want = aggregate_loss(test, mask, seq_ids, mode=mode, counts=counts,
                          num_local_seqs=num_local_seqs)
    if not torch.allclose((c * test).sum(), want, rtol=1e-9, atol=1e-12):
        raise ValueError(f"loss_agg={mode!r} is not linear in the per-token loss")
    return c.float()


def local_counts(mask: Tensor, num_local_seqs: int) -> Tensor:
    """[valid tokens, sequences] of one chunk: a float64 [2] tensor on mask's device (no host
    sync), to sum over micro-batches and all-reduce over DP, then `LossCounts.from_totals`."""
    seqs = torch.tensor(float(num_local_seqs), dtype=torch.float64, device=mask.device)
    return torch.stack([mask.to(torch.float64).sum(), seqs])


# ---------------------------------------------------------------------------------------------
# KL


def kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL").

    With log r = ref_logp - logp: k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r.
    logp, ref_logp: [T] -> [T]. Reference implementation; the fused kernel has its own.
    """
    log_r = ref_logp - logp
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r * log_r
    if estimator == "k3":
        return torch.expm1(log_r) - log_r
    raise ValueError(f"kl_estimator={estimator!r}: use 'k1', 'k2' or 'k3'")


def kl_clamp(estimator: str, clamp_input: float, clamp_output: float) -> tuple[float, float] | None:
    """The (input, output) clamp of the fused kernel's `kl_penalty`, for the loss and the
    KL-in-reward path alike. Only k3 and k3_is are clamped (exp() overflows; 0 = that clamp
    off); k1 and k2 cannot overflow and a clamp would only zero their gradient: None."""
    if estimator not in ("k3", "k3_is"):
        return None
    return (clamp_input or math.inf, clamp_output or math.inf)


def kl_penalized_rewards(
    rewards: Tensor, token_kl: Tensor, mask: Tensor, seq_ids: Tensor, beta: float
) -> tuple[Tensor, dict[str, float]]:
    """KL as a reward penalty: r_i - beta * sum_t kl_{i,t} over sequence i's valid tokens.

    rewards: [N]; token_kl, mask, seq_ids: [T] (seq_ids index rows of rewards) -> [N], metrics.
    """
    seq_kl = per_sequence_sum(token_kl.to(rewards.dtype), mask, seq_ids, rewards.numel())
    return rewards - beta * seq_kl, {"kl_seq_mean": float(seq_kl.mean().item())}


def bad_rewards(rewards: Tensor, max_abs: float) -> Tensor:
    """[N] -> [N] bool: non-finite rewards, or |reward| > max_abs (0 = no bound). An absurd but
    finite reward (1e30) overflows the group std and the gradient norm in fp32."""
    bad = ~torch.isfinite(rewards)
    return bad | (rewards.abs() > max_abs) if max_abs > 0 else bad


# ---------------------------------------------------------------------------------------------
# DAPO: dynamic sampling, overlong shaping, truncation masking


def filter_groups(rewards: Tensor, group_size: int) -> tuple[Tensor, int]:
    """DAPO dynamic sampling: keep groups whose rewards are not all equal (they carry signal).

    rewards: [B*G] -> (keep [B] bool, number kept). The trainer samples more prompts to top up.
    """
    grouped = rewards.view(-1, group_size)
    keep = grouped.amax(dim=1) != grouped.amin(dim=1)
    return keep, int(keep.sum().item())


def overlong_penalty(
    lengths: Tensor,
    max_len: int,
    buffer: int,
    penalty: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """DAPO soft overlong punishment (Eq. 13), to add to the reward.

    0 up to max_len - buffer, then linear down to -penalty at max_len, -penalty beyond.
    lengths: [N] completion lengths in tokens -> [N] (<= 0). buffer 0 disables it.
    """
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=dtype)
    over = (lengths.to(torch.float64) - (max_len - buffer)).clamp(min=0) / buffer
    return (-penalty * over.clamp(max=1.0)).to(dtype)


def mask_truncated(
    mask: Tensor, seq_ids: Tensor, truncated: Tensor
) -> tuple[Tensor, dict[str, float]]:
    """Drop completions that hit max length without EOS from the loss (DAPO overlong filtering).

    mask, seq_ids: [T]; truncated: [S] bool -> (mask [T], metrics{truncated_frac}).
    """
    keep = ~expand_to_tokens(truncated.bool(), seq_ids)
    frac = float(truncated.float().mean().item()) if truncated.numel() else 0.0
    return mask * keep.to(mask.dtype), {"truncated_frac": frac}


# ---------------------------------------------------------------------------------------------
# rollout importance sampling (vLLM sampler vs trainer log-probs)


def rollout_is_correction(
    old_logp: Tensor,
    rollout_logp: Tensor,
    mask: Tensor,
    seq_ids: Tensor,
    *,
    mode: str,
    cap: float = 2.0,
    low: float = 0.5,
    high: float = 2.0,
    num_local_seqs: int | None = None,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Correct for the sampler (vLLM) differing from the trainer's old policy.

    ratio_t = exp(old_logp_t - rollout_logp_t). Modes:
      none:       weights 1, mask unchanged (metrics only)
      truncate:   weights min(ratio, cap) (truncated IS), mask unchanged
      token_mask: weights 1, tokens with ratio outside [low, high] masked
      seq_mask:   weights 1, sequences whose geometric-mean ratio is outside [low, high] masked
    old_logp, rollout_logp, mask, seq_ids: [T] -> (weights [T], mask [T], metrics).
    """
    log_ratio = (old_logp - rollout_logp).to(torch.promote_types(old_logp.dtype, torch.float32))
    ratio = log_ratio.exp()
    weights = torch.ones_like(ratio)
    outside = torch.zeros_like(mask, dtype=torch.bool)
    if mode == "truncate":
        weights = ratio.clamp(max=cap)
    elif mode == "token_mask":
        outside = (ratio < low) | (ratio > high)
    elif mode == "seq_mask":
        s = num_sequences(seq_ids, num_local_seqs)
        geo = per_sequence_mean(log_ratio, mask, seq_ids, s).exp()
        outside = expand_to_tokens((geo < low) | (geo > high), seq_ids)
    elif mode != "none":
        raise ValueError(f"rollout_is={mode!r}: use 'none', 'truncate', 'token_mask' or 'seq_mask'")
    new_mask = mask * (~outside).to(mask.dtype)
    return weights, new_mask, _rollout_is_metrics(log_ratio, weights, mask, new_mask, cap)


def _rollout_is_metrics(
    log_ratio: Tensor, weights: Tensor, mask: Tensor, new_mask: Tensor, cap: float
) -> dict[str, float]:
    valid = mask.bool()
    gap = log_ratio.abs()[valid]
    n = max(int(valid.sum().item()), 1)
    return {
        "rollout_logp_gap_mean": float(gap.mean().item()) if gap.numel() else 0.0,
        "rollout_logp_gap_max": float(gap.max().item()) if gap.numel() else 0.0,
        "rollout_is_masked_frac": float((valid & ~new_mask.bool()).sum().item()) / n,
        "rollout_is_capped_frac": float((log_ratio.exp()[valid] > cap).sum().item()) / n,
        "rollout_is_weight_mean": float(masked_mean(weights, new_mask).item()),
    }


# ---------------------------------------------------------------------------------------------
# metrics


def clip_fractions(
    ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip_c: float = 0.0,
) -> dict[str, float]:
    """Fractions of valid tokens where a clip is active (the gradient is cut).

    low: A < 0 and ratio < 1 - eps_low; high: A > 0 and ratio > 1 + eps_high;
    dual: A < 0 and ratio > c (only when c > 0). ratio, advantages (per token), mask: [T].
    """
    low = (advantages < 0) & (ratio < 1.0 - eps_low)
    high = (advantages > 0) & (ratio > 1.0 + eps_high)
    dual = (advantages < 0) & (ratio > dual_clip_c) if dual_clip_c > 0 else torch.zeros_like(low)
    out = {"clip_frac_low": low, "clip_frac_high": high, "clip_frac_dual": dual}
    out["clip_frac"] = low | high
    return {k: float(masked_mean(v.to(ratio.dtype), mask).item()) for k, v in out.items()}


def completion_metrics(lengths: Tensor, truncated: Tensor) -> dict[str, float]:
    """Completion lengths (tokens) and truncation rate. lengths, truncated: [N]."""
    lf = lengths.to(torch.float64)
    return {
        "length_mean": float(lf.mean().item()),
        "length_max": float(lf.max().item()),
        "length_min": float(lf.min().item()),
        "truncated_frac": float(truncated.to(torch.float64).mean().item()),
    }


def reward_metrics(rewards: Tensor, group_size: int, correct: Tensor | None = None,
                   solved: float = 1.0) -> dict[str, float]:
    """Reward summary: mean/std, pass@G (a group has a correct completion), fraction of groups
    all-solved / all-unsolved / with zero reward spread. rewards: [B*G]; correct: [B*G] bool
    (the correctness term's verdict), or None to call a summed reward >= `solved` correct."""
    grouped = rewards.view(-1, group_size).to(torch.float64)
    hit = grouped >= solved if correct is None else correct.view(-1, group_size).bool()
    return {
        "reward_mean": float(grouped.mean().item()),
        "reward_std": float(grouped.std().item()) if grouped.numel() > 1 else 0.0,
        "pass_at_g": float(hit.any(dim=1).double().mean().item()),
        "groups_all_solved": float(hit.all(dim=1).double().mean().item()),
        "groups_none_solved": float((~hit).all(dim=1).double().mean().item()),
        "groups_zero_std": float((grouped.amax(1) == grouped.amin(1)).double().mean().item()),
    }
