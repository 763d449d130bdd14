"""Fused Triton kernels over vocab-parallel logits (imported as megagrpo.kernels).

Depends only on torch and (optionally) triton. Public API:

- ``token_logprob`` / ``token_loss`` (``ops``): per-token log-prob (+ entropy) and the GRPO
  per-token loss, from logits ``[T, V_local]`` or from hidden states ``[T, H]`` and this
  rank's output weight ``[V_local, H]`` (the fused output layer: no ``[T, V_local]`` logits).
- ``LossSpec`` (the loss options, frozen, checked once), ``TokenInputs`` (the per-token
  tensors), ``VocabPass`` (group, path and memory knobs of the vocab pass).
- ``loss_from_logp``: the loss's ``[T]`` algebra from log-probs computed elsewhere.
- ``kl_penalty``: the k1/k2/k3/k3_is estimators on ``[T]`` log-probs.
- ``vocab_parallel_logprob`` / ``fused_output_logprob``: the two forms' log-prob ops.
- ``fused_output_token_loss``: a weighted sum of token-separable per-token losses from hidden
  states, its gradient computed in the forward.
- ``grpo_token_loss``, ``fused_output_grpo_loss``, ``fused_output_grpo_weighted_loss``: the
  loss options as loose keywords (thin wrappers of ``token_loss``, for tests and scripts).
- ``active_path``: which path ("triton" | "torch") ``impl="auto"`` takes for a tensor.
"""
from .dispatch import VocabPass, active_path
from .fused_output import (
    fused_output_grpo_loss,
    fused_output_grpo_weighted_loss,
    fused_output_logprob,
    fused_output_token_loss,
)
from .grpo_loss import LossSpec, SequenceSplit, TokenInputs, kl_penalty, loss_from_logp
from .logprob import vocab_parallel_logprob
from .ops import grpo_token_loss, token_logprob, token_loss

__all__ = [
    "LossSpec", "SequenceSplit", "TokenInputs", "VocabPass", "active_path",
    "fused_output_grpo_loss", "fused_output_grpo_weighted_loss", "fused_output_logprob",
    "fused_output_token_loss", "grpo_token_loss", "kl_penalty", "loss_from_logp",
    "token_logprob", "token_loss", "vocab_parallel_logprob",
]
