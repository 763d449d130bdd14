"""The rules of context parallelism (parallel.cp) that hold before anything starts: what the
CPU path (`megagrpo.context_parallel`) and the run loop (`megagrpo train`) are built and tested
for, and the fields that refuse the rest, each by name."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megagrpo.config.model import ModelConfig, ParallelConfig


def check_context_parallel(parallel: ParallelConfig, model: ModelConfig) -> None:
    """The layout's part: cp >= 1; cp > 1 only with pp = 1, a dense model, no sequence
    parallelism and megagrpo's SDPA attention on the local spec."""
    cp = parallel.cp
    if cp < 1:
        raise ValueError(f"parallel.cp={cp} must be >= 1 (1 = no context parallelism)")
    if cp == 1:
        return
    refusals = (
        (parallel.pp > 1, f"parallel.pp={parallel.pp}: the chunked sequences are not passed "
                          "between pipeline stages; set parallel.pp=1"),
        (model.is_moe, f"model.architecture={model.architecture!r} (mixture of experts): the "
                       "router's load-balancing statistics are not reduced over CP; use a "
                       "dense model"),
        (parallel.sequence_parallel, "parallel.sequence_parallel=true: not combined with "
                                     "context parallelism yet; set sequence_parallel=false"),
        (parallel.attention_impl == "megatron", "parallel.attention_impl='megatron': its "
                                                "DotProductAttention has no context-parallel "
                                                "path; set attention_impl=auto or sdpa"),
        (parallel.transformer_impl == "transformer_engine",
         "parallel.transformer_impl='transformer_engine': Transformer Engine's context-"
         "parallel attention is not wired in; set transformer_impl=local"),
    )
    for refused, why in refusals:
        if refused:
            raise ValueError(f"parallel.cp={cp} with {why}")


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
