"""The training rules of context parallelism (parallel.cp) that hold before anything starts:
what the run loop (`megagrpo train`) is built and tested for, and the fields that refuse the
rest, each by name. The layout's own rules are `ParallelConfig._validate_cp`."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megagrpo.config.model import ParallelConfig


def check_context_parallel_training(algo, compute, parallel: ParallelConfig, *,
                                    placement: str = "colocated") -> None:
    """The training part: bnpo's per-micro-batch token mean and routing replay are not reduced
    over CP. The run (`megagrpo train`) pairs CP with colocated engines only: each CP rank's
    engine samples its share of the replica's prompts (`megagrpo.config.layout`); separate
    placement's training ranks are not wired for CP."""
    if parallel.cp == 1:
        return
    if placement == "separate":
        raise ValueError(f"rollout.placement='separate' with parallel.cp={parallel.cp}: the "
                         "training ranks of separate placement are not wired for context "
                         "parallelism; set rollout.placement=colocated or parallel.cp=1")
    if algo.loss_agg == "bnpo":
        raise ValueError(f"algo.loss_agg='bnpo' with parallel.cp={parallel.cp}: its token mean "
                         "per micro-batch is not reduced over the context-parallel ranks; use "
                         "algo.loss_agg=dapo (the step's token mean) or parallel.cp=1")
    if algo.routing_replay:
        raise ValueError(f"algo.routing_replay=true with parallel.cp={parallel.cp}: set "
                         "algo.routing_replay=false or parallel.cp=1")
