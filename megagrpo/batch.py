"""Rollout completions -> padded training tensors and micro-batches.

Layout: N sequences (prompt + completion) right-padded to S tokens, `ids` [N, S]. Position t's
logits predict token t+1, so every per-token tensor is [N, S] aligned with the logits: `target`
[N, S] = ids shifted left (last column unused), `mask` [N, S] True where the target is a
completion token. Keeping S columns (not S-1) lets the logits [b, S, V_local] flatten to
[b*S, V_local] as a view, with no copy of the biggest tensor in the step.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor


@dataclass
class Batch:
    """One DP replica's training data for a step (identical on its TP/PP ranks)."""

    ids: Tensor
    """[N, S] int64 prompt + completion tokens, right-padded."""
    target: Tensor
    """[N, S] int64 next-token targets (ids shifted left)."""
    mask: Tensor
    """[N, S] bool: the target is a completion token that counts in the loss."""
    advantages: Tensor
    """[N, S] fp32 per-token advantages (the sequence's value on its tokens)."""
    rollout_logp: Tensor
    """[N, S] fp32 vLLM's sampling log-probs of the targets (0 off-mask)."""
    seq_valid: Tensor
    """[N] bool: a real sequence (False for padding rows added to fill micro-batches)."""
    old_logp: Tensor | None = None
    """[N, S] fp32 trainer log-probs before the update (last stage; None = on-policy)."""
    ref_logp: Tensor | None = None
    """[N, S] fp32 reference log-probs (last stage; None without a reference)."""
    is_weight: Tensor | None = None
    """[N, S] fp32 rollout importance weights (None = off)."""

    @property
    def num_seqs(self) -> int:
        return self.ids.shape[0]

    def rows(self, lo: int, hi: int) -> "Batch":
        """Rows [lo, hi) of every tensor (views)."""
        kw = {f.name: (getattr(self, f.name)[lo:hi] if getattr(self, f.name) is not None
                       else None) for f in fields(self)}
        return Batch(**kw)

    def micro_batches(self, size: int) -> list["Batch"]:
        return [self.rows(i, i + size) for i in range(0, self.num_seqs, size)]


def pack(prompts: list[list[int]], completions: list[list[int]], rollout_logps: list[list[float]],
         seq_advantages: Tensor, *, pad_id: int, multiple: int = 1,
         completion_mask: Tensor | None = None) -> Batch:
    """Builds a `Batch` from N = len(completions) sequences (prompts[i] belongs to sequence i).

    `multiple`: N is padded with dummy rows (mask False) to a multiple of it, so every
    micro-batch has the same shape (pipeline parallelism needs that). `completion_mask` [N]
    False drops a sequence from the loss (e.g. truncated completions)."""
    n = len(completions)
    S = max(len(p) + len(c) for p, c in zip(prompts, completions))
    rows = -(-n // multiple) * multiple
    ids = torch.full((rows, S), pad_id, dtype=torch.long)
    mask = torch.zeros(rows, S, dtype=torch.bool)
    rlogp = torch.zeros(rows, S, dtype=torch.float32)
    adv = torch.zeros(rows, S, dtype=torch.float32)
    for i, (p, c, lp) in enumerate(zip(prompts, completions, rollout_logps)):
        L = len(p)
        ids[i, :L] = torch.tensor(p, dtype=torch.long)
        if c:
            ids[i, L:L + len(c)] = torch.tensor(c, dtype=torch.long)
            keep = completion_mask is None or bool(completion_mask[i])
            mask[i, L - 1:L - 1 + len(c)] = keep
            rlogp[i, L - 1:L - 1 + len(lp)] = torch.tensor(lp, dtype=torch.float32)
            adv[i, L - 1:L - 1 + len(c)] = float(seq_advantages[i])
    target = torch.roll(ids, -1, dims=1)
    target[:, -1] = pad_id
    valid = torch.zeros(rows, dtype=torch.bool)
    valid[:n] = True
    return Batch(ids=ids, target=target, mask=mask, advantages=adv, rollout_logp=rlogp,
                 seq_valid=valid)


def sft_batch(prompts: list[list[int]], completions: list[list[int]], *, pad_id: int,
              multiple: int = 1) -> Batch:
    """A supervised batch (cold start): same layout, advantages 1, no rollout log-probs."""
    zeros = [[0.0] * len(c) for c in completions]
    return pack(prompts, completions, zeros, torch.ones(len(completions)), pad_id=pad_id,
                multiple=multiple)
