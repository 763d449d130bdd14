"""A megatron-core model trained by hand on a torchrun worker's ranks (tests/_*_worker.py): the
model in DDP with its optimizer, one backward over a batch's rows, what the optimizer holds.

megagrpo (and with it megatron-core) is imported inside the functions, as the workers do: the
parent tests import some worker modules for their constants without initialising megatron."""
from __future__ import annotations

import torch


def ddp_and_optimizer(gpt, ocfg) -> tuple:
    """`gpt` wrapped in megatron's DDP and the optimizer `ocfg` (an OptimConfig) builds for it,
    the gradients zeroed: ready for `forward_backward`. Returns (ddp, optimizer)."""
    from megagrpo.model.optim import build_optimizer, wrap_ddp, zero_grad

    ddp = wrap_ddp(gpt, ocfg)
    opt = build_optimizer(ddp, ocfg)
    zero_grad(ddp, opt)
    return ddp, opt


def backward_rows(ddp, forward, ids: torch.Tensor, labels: torch.Tensor) -> None:
    """megatron's forward_backward over `ids` / `labels` [B, S] as B micro-batches of one row
    each: the reduced gradient is the mean over the rows (and over the DP ranks)."""
    from megagrpo.model.optim import forward_backward

    mbs = [(ids[i:i + 1], labels[i:i + 1]) for i in range(ids.shape[0])]
    forward_backward(ddp, forward, mbs, len(mbs), seq_length=ids.shape[1], micro_batch_size=1)
