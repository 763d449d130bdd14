"""The loss functions handed to megatron's schedule, one per kind of pass.

Each runs on the last pipeline stage with this micro-batch's logits [b, S, V_local] (or
[1, n, V_local] at loss positions), or - with the fused output layer (`weight` given) - the
hidden states [n, h] at the loss positions and the output weight [V_local, h], and returns
(loss, report) as megatron-core expects. Both reach the same per-token algebra
(`megagrpo.kernels.token_loss` with one `LossSpec`, built from the algo config once per
`LossContext` by `loss_spec` and reused by every micro-batch); only the vocab pass differs
(`vocab_pass`). With the fused layer the training losses hand the op their aggregation as
per-token weights (`aggregation_weights`), so it computes the gradient during the forward
(three output-layer matmuls, not four); GSPO's sequence-level ratio is not token-separable and
takes the op's recomputing backward.

Megatron divides a 2-tuple loss by the number of micro-batches and DDP averages grads over DP
ranks; our losses are already each chunk's share of the global step loss (global normalisers),
so they are multiplied back by both.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from megagrpo.algo import LossCounts, aggregate_loss, aggregation_weights, kl_clamp
from megagrpo.config.algo import AlgoConfig
from megagrpo.kernels import (
    LossSpec,
    SequenceSplit,
    TokenInputs,
    VocabPass,
    fused_output_token_loss,
    token_logprob,
    token_loss,
)
from megagrpo.parallel.batch import Batch
from megagrpo.parallel.positions import put, take

PAD_LOGIT = -1e9
"""Logit given to vocab padding columns: exp() underflows to exactly 0, and 0 * PAD_LOGIT
stays finite in the entropy sum (unlike -inf)."""


@dataclass(kw_only=True)
class LossContext:
    """What every micro-batch's loss needs besides its own data."""

    tp_group: object
    """Tensor-parallel group of the vocab-parallel logits."""
    valid_local_vocab: int
    """Columns of this rank's vocab slice that are real tokens (the rest is padding)."""
    temperature: float
    """Sampling temperature (logits are scaled as vLLM scaled them)."""
    impl: str
    """Kernel path."""
    scale: float = 1.0
    """num_microbatches * dp: undoes megatron's averaging (see module doc)."""
    counts: LossCounts | None = None
    """Global normalisers of the optimizer step."""
    algo: AlgoConfig | None = None
    """GRPO variant (training passes)."""
    inplace_backward: bool = False
    """Kernel may write the logits gradient into the logits buffer."""
    spec: LossSpec | None = None
    """The GRPO loss options: built from `algo` (`loss_spec`) when not given; every
    micro-batch of this context reuses it."""

    def __post_init__(self) -> None:
        if self.spec is None and self.algo is not None:
            self.spec = loss_spec(self.algo, self.temperature)


def loss_spec(a: AlgoConfig, temperature: float) -> LossSpec:
    """The kernels' loss options for the algo config (checked by `LossSpec` itself): loss_agg
    cispo selects CISPO's policy term and its own upper truncation, gspo the sequence-level
    ratio; KL in the reward leaves none in the loss."""
    cispo = a.loss_agg == "cispo"
    return LossSpec(
        policy_loss="cispo" if cispo else a.policy_loss, eps_low=a.eps_low,
        eps_high=a.cispo_eps_high if cispo else a.eps_high, dual_clip_c=a.dual_clip_c or None,
        ratio_level="sequence" if a.loss_agg == "gspo" else "token",
        beta=0.0 if a.kl_in_reward else a.beta, kl_estimator=a.kl_estimator,
        kl_clamp=kl_clamp(a.kl_estimator, a.kl_clamp_input, a.kl_clamp_output),
        sapo_tau_pos=a.sapo_tau_pos, sapo_tau_neg=a.sapo_tau_neg, temperature=temperature)


def flat_logits(logits: Tensor, ctx: LossContext) -> Tensor:
    """[b, S, V_local] -> [b*S, V_local] view, with vocab padding columns masked in place."""
    flat = logits.view(-1, logits.shape[-1])
    if ctx.valid_local_vocab < flat.shape[1]:
        flat[:, ctx.valid_local_vocab:] = PAD_LOGIT
    return flat


def _seq_ids(mb: Batch, positions: Tensor | None) -> Tensor:
    """[T] row (sequence) of each token the logits cover."""
    b, S = mb.target.shape
    return (torch.arange(b, device=mb.target.device).repeat_interleave(S) if positions is None
            else positions // S)


def vocab_pass(ctx: LossContext, out: Tensor, weight: Tensor | None, target: Tensor,
               mask: Tensor, *, with_entropy: bool, inplace: bool = False,
               temperature: float | None = None):
    """Per-token log-probs [n] (and entropy) of `target` from the logits `out` (weight None) or
    through the fused output layer from the hidden states `out` [n, h] and `weight`.
    `temperature`: None = the sampling temperature (ctx)."""
    x = out if weight is not None else flat_logits(out, ctx)
    return token_logprob(x, target, weight=weight,
                         temperature=ctx.temperature if temperature is None else temperature,
                         ignore_mask=~mask, with_entropy=with_entropy,
                         run=VocabPass(group=ctx.tp_group, impl=ctx.impl,
                                       valid_vocab=ctx.valid_local_vocab,
                                       inplace_backward=inplace))


def logprob_loss(ctx: LossContext, mb: Batch, out: Tensor, positions: Tensor | None = None,
                 weight: Tensor | None = None):
    """Scoring pass (no grad): per-token log-probs of the targets, [b, S]. `positions`: the
    flat [b*S] indices the logits [1, n, V_local] cover (None: logits [b, S, V_local]);
    `weight`: `out` is hidden states for the fused output layer (module doc)."""
    with torch.no_grad():
        logp = vocab_pass(ctx, out, weight, take(mb.target, positions), take(mb.mask, positions),
                          with_entropy=False)
    return out.new_zeros(()), {"logp": put(logp, positions, tuple(mb.target.shape))}


def grpo_loss(ctx: LossContext, mb: Batch, out: Tensor, positions: Tensor | None = None,
              weight: Tensor | None = None):
    """Training pass: fused per-token GRPO loss -> this chunk's share of the step loss.
    `positions` and `weight` as in `logprob_loss`."""
    b, S = mb.target.shape
    mask = take(mb.mask, positions)
    seq_ids = _seq_ids(mb, positions)
    # context parallelism: the rows continue on the other CP ranks (GSPO's ratio sums there)
    group = getattr(mb, "cp_group", None)
    inputs = TokenInputs(take(mb.old_logp, positions), take(mb.advantages, positions), mask,
                         ref_logp=take(mb.ref_logp, positions),
                         is_weight=take(mb.is_weight, positions), seq_ids=seq_ids,
                         seq_split=None if group is None else SequenceSplit(group, b))
    run = VocabPass(group=ctx.tp_group, impl=ctx.impl, valid_vocab=ctx.valid_local_vocab,
                    inplace_backward=ctx.inplace_backward)
    counts = ctx.counts
    if getattr(mb, "seq_tokens", None) is not None:  # context parallelism: rows in chunks
        counts = replace(counts, seq_tokens=mb.seq_tokens)
    agg = dict(mode=ctx.algo.loss_agg, counts=counts, num_local_seqs=b)
    target = take(mb.target, positions)
    if weight is None:
        tok_loss, _, m = token_loss(flat_logits(out, ctx), target, ctx.spec, inputs, run=run)
        loss = aggregate_loss(tok_loss, mask.float(), seq_ids, **agg)
    else:  # the same algebra, aggregated inside the fused op (its gradient in the forward)
        loss, _, m = token_loss(out, target, ctx.spec, inputs, weight=weight, run=run,
                                token_weight=aggregation_weights(mask.float(), seq_ids, **agg))
    f = mask.float()
    report = {
        "loss": loss.detach(),  # this chunk's share: chunks and DP ranks sum to the step loss
        "tokens": f.sum(),
        "kl_sum": (m["kl"] * f).sum(),
        "entropy_sum": (m["entropy"] * f).sum(),
        "clip_low_sum": (m["clipped_low"].float() * f).sum(),
        "clip_high_sum": (m["clipped_high"].float() * f).sum(),
        "clip_dual_sum": (m["clipped_dual"].float() * f).sum(),
        "ratio_sum": (m["ratio"] * f).sum(),
        "logp": put(m["logp"].detach(), positions, (b, S)),
    }
    return loss * ctx.scale, report


def sft_loss(ctx: LossContext, mb: Batch, out: Tensor, positions: Tensor | None = None,
             weight: Tensor | None = None):
    """Cold start: token-mean negative log-likelihood of the completion tokens (temperature 1:
    the data's likelihood, not the sampler's)."""
    mask = take(mb.mask, positions)
    target, norm = take(mb.target, positions), max(ctx.counts.num_tokens, 1.0)
    if weight is None:
        logp = vocab_pass(ctx, out, weight, target, mask, with_entropy=False,
                          inplace=ctx.inplace_backward, temperature=1.0)
        loss = -(logp * mask.float()).sum() / norm
    else:  # -logp per token, weighted: the fused op's gradient-in-forward path
        loss, logp, _ = fused_output_token_loss(
            out, weight, target, mask.float() / norm, group=ctx.tp_group, ignore_mask=~mask,
            valid_vocab=ctx.valid_local_vocab, impl=ctx.impl)
    return loss * ctx.scale, {"nll_sum": -(logp.detach() * mask.float()).sum(),
                              "tokens": mask.float().sum()}
