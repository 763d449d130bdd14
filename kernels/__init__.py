"""Fused Triton kernels over vocab-parallel logits (imported as megagrpo.kernels).

Depends only on torch and (optionally) triton. Public API:

- ``vocab_parallel_logprob``: per-token log-prob (+ entropy) from ``[T, V_local]`` logits.
- ``grpo_token_loss``: per-token GRPO/GSPO/CISPO loss with clip, dual clip, KL, IS weights.
- ``grpo_loss_from_logp``: the same per-token algebra from log-probs computed elsewhere.
- ``kl_penalty``: the k1/k2/k3 estimators on ``[T]`` log-probs.
- ``fused_output_logprob`` / ``fused_output_grpo_loss``: the same from the final hidden states
  and this rank's output weight, with no ``[T, V_local]`` logits (the fused output layer).
- ``fused_output_token_loss`` / ``fused_output_grpo_weighted_loss``: a weighted sum of
  token-separable per-token losses from hidden states, its gradient computed in the forward.
- ``active_path``: which path ("triton" | "torch") ``impl="auto"`` takes for a tensor.
"""
from .dispatch import active_path
from .fused_output import (
    fused_output_grpo_loss,
    fused_output_grpo_weighted_loss,
    fused_output_logprob,
    fused_output_token_loss,
)
from .grpo_loss import grpo_loss_from_logp, grpo_token_loss, kl_penalty
from .logprob import vocab_parallel_logprob

__all__ = [
    "active_path", "fused_output_grpo_loss", "fused_output_grpo_weighted_loss",
    "fused_output_logprob", "fused_output_token_loss", "grpo_loss_from_logp",
    "grpo_token_loss", "kl_penalty", "vocab_parallel_logprob",
]
