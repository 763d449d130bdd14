"""The planner's lines for separate placement (rollout.placement=separate): the training ranks
hold no vLLM share, and the rollout ranks form engines of rollout.tensor_parallel_size ranks,
each rank holding its engine's slice of the weights (the whole model at TP 1) plus the KV cache
its rollout.gpu_memory_utilization leaves."""
from __future__ import annotations

import dataclasses

from megagrpo.config.model import ModelConfig
from megagrpo.config.train import TrainConfig
from megagrpo.plan.memory import GIB, RankMemory, rank_memory


def format_separate(cfg: TrainConfig, m: ModelConfig, train: RankMemory, train_world: int,
                    gpu_mem_gib: float) -> str:
    """Where the ranks go and what each kind holds (`train`: a training rank's memory, which
    `megagrpo.plan.rank_memory` gives without a vLLM share under separate placement)."""
    colocated = dataclasses.replace(cfg, rollout=dataclasses.replace(
        cfg.rollout, placement="colocated", rollout_ranks=0))
    k = cfg.rollout.tensor_parallel_size
    engine = rank_memory(colocated, m, 1, 1, 1, gpu_mem_gib, vllm_tp=k)  # its vLLM fields
    R, seqs = cfg.rollout.rollout_ranks, engine.kv_tokens // cfg.rollout.max_model_len
    of = "the whole model" if k == 1 else f"1/{k} of the model's sharded tensors"
    return "\n".join([
        f"separate placement: {train_world} training rank(s) (ranks 0-{train_world - 1}) + "
        f"{R} rollout rank(s) (ranks {train_world}-{train_world + R - 1}), world "
        f"{train_world + R}",
        f"  training rank peak: {train.total / GIB:.2f} GiB (no vLLM share)",
        f"  rollout rank: 1 of the {k} rank(s) of one of {R // k} vLLM engine(s) of TP {k}, "
        f"share {engine.vllm / GIB:.2f} GiB (rollout.gpu_memory_utilization="
        f"{cfg.rollout.gpu_memory_utilization:g}): weights {engine.vllm_weights / GIB:.2f} GiB "
        f"({of}) + KV cache {engine.kv_cache / GIB:.2f} GiB = {engine.kv_tokens} tokens "
        f"({seqs} sequences of {cfg.rollout.max_model_len} at once)"
        + ("" if engine.kv_cache > 0 else "; it cannot start: raise "
           "rollout.gpu_memory_utilization or rollout.tensor_parallel_size"),
    ])


__all__ = ["format_separate"]
