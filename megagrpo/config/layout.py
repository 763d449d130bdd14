"""The rollout layout in one place: which ranks form each vLLM engine, which prompts each engine
samples, and whether its weights can be fed shard to shard.

With `rollout.tensor_parallel_size = k`, the world's ranks form world/k vLLM engines of k
consecutive ranks (engine e = ranks [e*k, (e+1)*k), vLLM's `external_launcher` mode; vLLM itself
groups the world as (external DP, TP) with TP fastest, so these are exactly its TP groups). The
engines are data-parallel replicas of the sampler: inside a training replica (the TP x CP x PP
ranks that train on one batch) the replica's engines sample disjoint, strided slices of its
prompts (engine j of n samples prompts j, j+n, ...), and the replica's ranks all-gather the
results. Context parallelism (parallel.cp) does not shard the weights, so each CP rank's engine
is an ordinary engine that samples its share of the replica's prompts.

Megatron numbers ranks TP fastest, then CP, then DP, then PP (rank = tp_rank + tp * (cp_rank +
cp * (dp_rank + dp * pp_rank))), so an engine of k consecutive ranks stays inside one training
replica exactly when k divides the training TP x CP, or DP = 1 (the replica is the whole
world). Otherwise an engine spans
several replicas, which draw different prompts: the layout is then `pooled`, the replicas'
prompts are all-gathered over the world (replica-major), engine e of E samples pool prompts e,
e+E, ..., the completions are all-gathered over the world and each replica keeps its own.

Shard to shard: when k equals the training TP, engine e's ranks are one training TP group with
vLLM TP rank = megatron TP rank, so each rank's training shard already holds its vLLM slice.
"""
from __future__ import annotations

from dataclasses import dataclass

from megagrpo.config.model import ModelConfig, ParallelConfig


@dataclass(frozen=True, kw_only=True)
class RolloutLayout:
    """Where one rank sits in the rollout layout (pure arithmetic on ranks; no process groups)."""

    rank: int
    """Global rank of this process."""
    world_size: int
    """Ranks in the torchrun world."""
    engine_tp: int
    """k = rollout.tensor_parallel_size: ranks per vLLM engine."""
    train_tp: int
    """Training tensor-parallel size (parallel.tp)."""
    train_pp: int
    """Training pipeline-parallel size (parallel.pp)."""
    train_cp: int = 1
    """Training context-parallel size (parallel.cp): ranks of a replica beside its TP ones."""

    @property
    def num_engines(self) -> int:
        """world / k engines in the whole world."""
        return self.world_size // self.engine_tp

    @property
    def engine(self) -> int:
        """This rank's engine index (0 .. num_engines-1)."""
        return self.rank // self.engine_tp

    @property
    def engine_rank(self) -> int:
        """This rank's vLLM TP rank inside its engine."""
        return self.rank % self.engine_tp

    @property
    def is_leader(self) -> bool:
        """vLLM TP rank 0: the rank that reports its engine's completions (every rank of an
        engine produces the same ones)."""
        return self.engine_rank == 0

    def engine_ranks(self, engine: int | None = None) -> list[int]:
        """Global ranks of `engine` (default: this rank's)."""
        e = self.engine if engine is None else engine
        return list(range(e * self.engine_tp, (e + 1) * self.engine_tp))

    @property
    def dp(self) -> int:
        """Training data-parallel size."""
        return self.world_size // (self.train_tp * self.train_cp * self.train_pp)

    @property
    def _tp_cp(self) -> int:
        """Consecutive ranks of one replica (at one pipeline stage): TP x CP."""
        return self.train_tp * self.train_cp

    @property
    def pooled(self) -> bool:
        """True when an engine spans several training replicas (k does not divide the training
        TP x CP and DP > 1): then the replicas' prompts are pooled over the world, every engine
        samples a strided slice of the pool, and each replica keeps its own prompts' results."""
        return self._tp_cp % self.engine_tp != 0 and self.dp > 1

    @property
    def engines_per_replica(self) -> int:
        """Engines that sample one training replica's prompts (pooled: all of them sample the
        pool)."""
        if self.pooled:
            return self.num_engines
        return max(1, self._tp_cp * self.train_pp // self.engine_tp)

    @property
    def replica_engine(self) -> int:
        """Index of this rank's engine among its replica's engines. Megatron's model-parallel
        rank (with CP: its rank among the replica's TP x CP x PP ranks) is
        (tp_rank + tp * cp_rank) + tp * cp * pp_rank, and an engine is k consecutive global
        ranks, which are k consecutive ranks of one replica (see the module docstring)."""
        if self.pooled:
            return self.engine
        replica_rank = self.rank % self._tp_cp + self._tp_cp * self._pp_rank
        return replica_rank // self.engine_tp

    @property
    def _pp_rank(self) -> int:
        return self.rank // (self._tp_cp * self.dp)

    def prompt_indices(self, num_prompts: int) -> list[int]:
        """Indices into the replica's prompt batch [num_prompts] (pooled: into the pool of all
        replicas' batches, replica-major) that this rank's engine samples (strided, so every
        engine gets within one prompt of the same count)."""
        return list(range(self.replica_engine, num_prompts, self.engines_per_replica))

    @property
    def shard_to_shard(self) -> bool:
        """True when each rank's training shard is its vLLM slice (k == training TP)."""
        return self.engine_tp > 1 and self.engine_tp == self.train_tp

    def describe(self) -> str:
        """One console line: the engines and what feeds them."""
        feed = ("shard to shard (k = training TP)" if self.shard_to_shard
                else "full tensors (vLLM slices them)" if self.engine_tp > 1
                else "full tensors")
        share = ("prompts pooled over the training replicas" if self.pooled
                 else f"{self.engines_per_replica} per training replica")
        return (f"rollout layout: {self.num_engines} vLLM engine(s) of {self.engine_tp} rank(s), "
                f"{share}; weights {feed}")


def check_rollout_layout(k: int, parallel: ParallelConfig, model: ModelConfig,
                         world_size: int | None) -> None:
    """Raise ValueError unless vLLM engines of k consecutive ranks fit the model and the world
    (run before any process starts). Every training layout `parallel` accepts any such k: an
    engine inside one replica samples that replica's prompts, one spanning several replicas
    samples their pooled prompts (`RolloutLayout.pooled`)."""
    heads, groups = model.num_attention_heads, model.num_query_groups
    if heads % k:
        ok = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ValueError(f"rollout.tensor_parallel_size={k} does not divide "
                         f"model.num_attention_heads={heads} (vLLM splits heads); valid: {ok}")
    if groups % k and k % groups:
        raise ValueError(f"rollout.tensor_parallel_size={k} and model.num_query_groups={groups}:"
                         " vLLM needs one to divide the other (KV heads split or replicated)")
    if world_size is None or k == 1:
        return
    if world_size % k:
        raise ValueError(f"rollout.tensor_parallel_size={k} does not divide the world size "
                         f"{world_size}: engines are k consecutive ranks; launch a multiple of "
                         f"{k} processes or choose k from "
                         f"{[d for d in range(1, world_size + 1) if world_size % d == 0]}")


__all__ = ["RolloutLayout", "check_rollout_layout"]
