"""The two public ops over this rank's vocab shard, each taking either form of the output
layer's input: logits ``[T, V_local]`` (``weight`` None: ``logprob``'s kernel), or the final
hidden states ``[T, H]`` with the output weight ``[V_local, H]`` (``fused_output``: no
``[T, V_local]`` logits).

- ``token_logprob``: per-token log-prob (+ entropy) of the targets.
- ``token_loss``: the GRPO per-token loss of a ``LossSpec`` on ``TokenInputs``, optionally
  reduced with per-token weights (the trainer's aggregation) to a scalar.

``VocabPass`` (``dispatch``) says how the vocab pass runs: group, path and memory knobs.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .dispatch import VocabPass
from .fused_output import fused_output_logprob, grpo_hidden_loss
from .grpo_loss import LossSpec, TokenInputs, from_keywords, loss_from_logp
from .logprob import vocab_parallel_logprob


def token_logprob(x: Tensor, target: Tensor, *, weight: Tensor | None = None,
                  temperature: float = 1.0, ignore_mask: Tensor | None = None,
                  with_entropy: bool = False, run: VocabPass = VocabPass()
                  ) -> Tensor | tuple[Tensor, Tensor]:
    """Log-prob ``[T]`` fp32 of ``target`` ``[T]`` under ``softmax(logits / temperature)``, and
    its entropy ``[T]`` with ``with_entropy``; 0 where ``ignore_mask`` ``[T]`` is True.

    ``x``: logits ``[T, V_local]`` (``weight`` None; ``vocab_parallel_logprob``) or hidden
    states ``[T, H]`` with ``weight`` ``[V_local, H]`` (``fused_output_logprob``).
    Differentiable w.r.t. ``x`` (and ``weight``).
    """
    if weight is None:
        return vocab_parallel_logprob(x, target, temperature=temperature, group=run.group,
                                      ignore_mask=ignore_mask, with_entropy=with_entropy,
                                      inplace_backward=run.inplace_backward, impl=run.impl)
    return fused_output_logprob(x, weight, target, temperature=temperature, group=run.group,
                                ignore_mask=ignore_mask, with_entropy=with_entropy,
                                valid_vocab=run.valid_vocab, impl=run.impl,
                                chunk_tokens=run.chunk_tokens, chunk_vocab=run.chunk_vocab)


def token_loss(x: Tensor, target: Tensor, spec: LossSpec, inputs: TokenInputs, *,
               weight: Tensor | None = None, token_weight: Tensor | None = None,
               run: VocabPass = VocabPass()) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """The GRPO per-token loss of ``spec`` (``grpo_loss``) from logits or hidden states.

    Args:
        x: logits ``[T, V_local]`` (``weight`` None) or hidden states ``[T, H]`` with
            ``weight`` ``[V_local, H]``, as in ``token_logprob``.
        target: ``[T]`` int64 sampled token ids (global vocab ids).
        spec: the loss options, checked when it was built; ``inputs`` are checked against it
            here, once per call.
        inputs: the per-token ``[T]`` tensors (old / reference log-probs, advantages, mask, ...).
        token_weight: ``[T]`` fp32 weights c (no gradient): the op returns
            ``sum_t c_t loss_t``; from hidden states its gradient is then computed in the
            forward where the loss is token-separable (``fused_output.grpo_hidden_loss``).
        run: how the vocab pass runs (``VocabPass``).

    Returns:
        ``(loss, token_loss, metrics)``: the differentiable per-token loss ``[T]`` fp32 (0 where
        ``mask`` is False), or with ``token_weight`` the weighted scalar; the detached
        per-token loss ``[T]``; metrics as ``grpo_loss.loss_from_logp``.
    """
    if weight is not None:
        return grpo_hidden_loss(x, weight, target, spec, inputs, token_weight, run)
    spec.check(inputs)
    logp, entropy = vocab_parallel_logprob(
        x, target, temperature=spec.temperature, group=run.group, ignore_mask=~inputs.mask.bool(),
        with_entropy=True, inplace_backward=run.inplace_backward, impl=run.impl)
    tok_loss, metrics = loss_from_logp(spec, inputs, logp, entropy)
    if token_weight is None:
        return tok_loss, tok_loss.detach(), metrics
    w = token_weight.detach().to(tok_loss.device, torch.float32)
    return (tok_loss * w).sum(), tok_loss.detach(), metrics


def grpo_token_loss(logits: Tensor, target: Tensor, old_logp: Tensor | None,
                    advantages: Tensor, mask: Tensor, **keywords
                    ) -> tuple[Tensor, dict[str, Tensor]]:
    """Thin keyword form of ``token_loss`` on logits: ``(loss [T], metrics)``; ``keywords`` as
    ``grpo_loss.from_keywords`` (the loss options, ``ref_logp``, ``group``, ``impl`` ...)."""
    spec, inputs, run = from_keywords(old_logp, advantages, mask, keywords)
    loss, _, metrics = token_loss(logits, target, spec, inputs, run=run)
    return loss, metrics
