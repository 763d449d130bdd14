"""Routing statistics of the policy's MoE layers for the step's metrics.

`RoutingMonitor` hooks every megatron router of this rank's policy stage and counts, per layer,
how many tokens each expert was chosen for during the update's forward passes (the router's
`routing_map` [tokens, E]), and reads megatron's tracker of the auxiliary losses (the
load-balancing loss before its coefficient, the z-loss). `metrics()` reduces both over the world
(TP ranks see the same tokens: only TP rank 0 counts; pipeline stages hold different layers;
DP replicas route their own tokens) into scalars:

- ``moe_max_load`` / ``moe_min_load``: over the MoE layers, the largest (smallest) ratio of an
  expert's tokens to the mean over experts; 1 is a perfectly balanced router, E / k the worst;
- ``moe_tokens_per_expert``: mean tokens per expert per layer over the step's update passes;
- ``moe_load_balancing_loss`` / ``moe_z_loss``: megatron's per-layer losses (without their
  coefficients), averaged over the layers and forward passes; present when enabled.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megagrpo.model import unwrap


def tracked_losses(model_cfg) -> tuple[str, ...]:
    """The names megatron's router tracks this model's enabled auxiliary losses under."""
    return tuple(name for name, coef in (("load_balancing_loss", model_cfg.moe_aux_loss_coef),
                                         ("z_loss", model_cfg.moe_z_loss_coef)) if coef > 0)


class RoutingMonitor:
    """Counts tokens per expert for every MoE layer of `model` (this rank's stage)."""

    def __init__(self, model: torch.nn.Module, num_layers: int, num_experts: int, *,
                 losses: tuple[str, ...] = (), counts_here: bool, group=None):
        """`num_layers` / `num_experts`: the whole model's; `losses`: the names megatron
        tracks the enabled auxiliary losses under (the same on every rank); `counts_here`:
        this rank's counts enter the world sum (TP rank 0); `group`: the reduction's group."""
        from megatron.core.transformer.moe.router import TopKRouter

        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self.calls = torch.zeros(num_layers, dtype=torch.float64)
        self.counts_here, self.group, self.losses = counts_here, group, losses
        self.routers = [m for m in unwrap(model).modules() if isinstance(m, TopKRouter)]
        for router in self.routers:
            router.register_forward_hook(self._count)

    def _count(self, router, args, output) -> None:
        if not router.training:
            return  # scoring passes (no grad, eval mode) are not the update's routing
        _, routing_map = output
        i = router.layer_number - 1
        self.counts[i] += routing_map.detach().sum(0).to(torch.float64).cpu()
        self.calls[i] += 1

    def reset(self) -> None:
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        self.counts.zero_()
        self.calls.zero_()
        clear_aux_losses_tracker()

    def metrics(self) -> dict[str, float]:
        """The step's routing scalars (collective over `group`; same keys on every rank)."""
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        tracker = get_moe_layer_wise_logging_tracker()
        names = self.losses
        losses = torch.zeros(len(names), dtype=torch.float64)
        if self.counts_here:
            for j, name in enumerate(names):
                if name in tracker:
                    losses[j] = tracker[name]["values"].double().sum().cpu()
        flat = torch.cat([self.counts.flatten(), self.calls, losses]) if self.counts_here else \
            torch.cat([torch.zeros_like(self.counts.flatten()), torch.zeros_like(self.calls),
                       losses])
        dist.all_reduce(flat, group=self.group)
        n = self.counts.numel()
        counts = flat[:n].view_as(self.counts)
        calls = flat[n:n + len(self.calls)]
        routed = counts.sum(1) > 0
        if not bool(routed.any()):
            return {}
        mean = counts[routed].mean(1, keepdim=True)
        load = counts[routed] / mean
        out = {"moe_max_load": float(load.max()), "moe_min_load": float(load.min()),
               "moe_tokens_per_expert": float(mean.mean())}
        for name, total in zip(names, flat[n + len(self.calls):].tolist()):
            out[f"moe_{name}"] = total / max(float(calls.sum()), 1.0)
        return out
