"""Process start-up: torchrun environment -> torch.distributed -> megatron parallel_state.

The only module that decides devices. On a machine without CUDA it installs the megatron-core
compatibility shim (`megagrpo.runtime.cpu_compat`) before megatron builds anything; parallel_state
starts inside the shim's scope.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megagrpo.config.model import ModelConfig, ParallelConfig
from megagrpo.runtime import cpu_compat, rng
from megagrpo.runtime.procs import free_port

log = logging.getLogger("megagrpo")


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the world and in the TP/PP/DP grid."""

    rank: int
    world_size: int
    local_rank: int
    tp_rank: int
    tp: int
    pp_rank: int
    pp: int
    dp_rank: int
    dp: int
    device: torch.device
    cp_rank: int = 0
    """Rank inside the context-parallel group."""
    cp: int = 1
    """Context-parallel size (parallel.cp)."""

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def torchrun_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the torchrun environment; a bare process is rank 0
    of 1 (MASTER_ADDR/PORT default to a local rendezvous)."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:  # a bare process: a port no one uses, never a fixed one
        os.environ["MASTER_PORT"] = str(free_port())
    return rank, world, local


def attempt_store(timeout: timedelta) -> dist.Store | None:
    """The default group's store on a torchrun restart (TORCHELASTIC_RESTART_COUNT > 0): the
    agent's store under a prefix of this attempt. torchrun hands every attempt of a job the same
    store (static rendezvous always, c10d unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) with no
    prefix of its own, so the restarted ranks' groups (megatron's, vLLM's) would read the
    addresses the attempt before published under the same keys and fail to connect (gloo:
    "Connection refused"). None on a first attempt or without the agent's store: torch's own."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"megagrpo/attempt{attempt}", agent)


MIXED_BACKEND = "cpu:gloo,cuda:nccl"
"""The default group's backend on CUDA: the step's own collectives (loss normalisers, metric
means, balancing counts, advantages) reduce small CPU tensors, which NCCL alone refuses; with
one backend per device type CPU tensors go over gloo and CUDA tensors over NCCL. Groups made
with `dist.new_group` and no backend (megatron-core's TP/PP/DP/CP groups) inherit it."""


def process_group_backend(backend: str, cuda: bool) -> str:
    """The torch.distributed backend string for parallel.backend ('auto', 'nccl', 'gloo'):
    'auto' and 'nccl' on CUDA are `MIXED_BACKEND`; without CUDA, 'auto' is gloo and 'nccl' is
    refused."""
    if backend == "nccl" and not cuda:
        raise ValueError("parallel.backend='nccl' needs CUDA; use 'gloo' or 'auto' on this machine")
    if backend == "gloo" or not cuda:
        return "gloo"
    return MIXED_BACKEND


def init_distributed(
    parallel: ParallelConfig, model: ModelConfig | None = None, *, seed: int = 1234
) -> DistInfo:
    """Starts torch.distributed and megatron's parallel_state with the configured TP, CP and PP
    (DP = world / (TP*CP*PP)). Validates the layout before anything is started."""
    rank, world, local = torchrun_env()
    if dist.is_initialized():  # the world was split first (rollout.placement=separate)
        rank, world = dist.get_rank(), dist.get_world_size()
    if model is not None:
        parallel.validate(model, world)
    elif world % (parallel.tp * parallel.pp * parallel.cp):
        raise ValueError(
            f"world size {world} is not divisible by parallel.tp x parallel.pp x parallel.cp = "
            f"{parallel.tp} x {parallel.pp} x {parallel.cp}; launch a multiple of "
            f"{parallel.tp * parallel.pp * parallel.cp} processes"
        )
    cuda = torch.cuda.is_available()
    backend = process_group_backend(parallel.backend, cuda)
    if cuda:
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        cpu_compat.apply()
        device = torch.device("cpu")
    # One timeout for every group: the default one here, megatron's below (its own default
    # is 30 min). A rank waiting longer in a collective raises instead of hanging.
    timeout = timedelta(seconds=parallel.collective_timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout,
                                store=attempt_store(timeout))
    from megatron.core import parallel_state as ps

    with cpu_compat.megatron_scope():
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tp, pipeline_model_parallel_size=parallel.pp,
            # CP ranks hold chunks of the same rows: megatron's DDP reduces over DP x CP
            context_parallel_size=parallel.cp,
            # experts: EP groups inside the DP ranks, each expert split over the TP ranks
            expert_model_parallel_size=parallel.ep, expert_tensor_parallel_size=parallel.tp,
            distributed_timeout_minutes=parallel.collective_timeout_s / 60,  # timedelta(minutes=)
        )
    rng.seed_tracker(seed)
    info = DistInfo(
        rank=rank, world_size=world, local_rank=local,
        tp_rank=ps.get_tensor_model_parallel_rank(), tp=parallel.tp,
        pp_rank=ps.get_pipeline_model_parallel_rank(), pp=parallel.pp,
        dp_rank=ps.get_data_parallel_rank(), dp=ps.get_data_parallel_world_size(),
        device=device, cp_rank=ps.get_context_parallel_rank(), cp=parallel.cp,
    )
    if rank == 0:
        # separate placement: this world is the training ranks' share of torchrun's
        launched = int(os.environ.get("WORLD_SIZE", world))
        log.info("distributed: backend=%s world=%d%s tp=%d pp=%d dp=%d%s%s device=%s%s", backend,
                 world, f" (training ranks; {launched} launched)" if launched != world else "",
                 info.tp, info.pp, info.dp,
                 f" ep={parallel.ep}" if parallel.ep > 1 else "",
                 f" cp={parallel.cp}" if parallel.cp > 1 else "", device.type,
                 " (megatron-core CPU shim active)" if not cuda else "")
    return info


@dataclass(frozen=True, kw_only=True)
class Ranks:
    """Where this rank sits in the training layout (megatron parallel_state)."""

    rank: int = 0
    """Global rank."""
    dp: int = 1
    """Data-parallel size."""
    dp_rank: int = 0
    """This rank's DP replica."""
    tp_rank: int = 0
    """Tensor-parallel rank."""
    pp: int = 1
    """Pipeline stages."""
    pp_last_rank: int = 0
    """Global rank of this rank's last-stage peer (where the loss and log-probs live)."""
    mp_rank: int = 0
    """Rank inside the model-parallel (TP x PP) group."""
    mp_size: int = 1
    """TP x PP."""
    valid_local_vocab: int = 0
    """Unpadded vocab rows on this TP rank's logits shard."""
    cp: int = 1
    """Context-parallel size: ranks holding chunks of the same rows."""
    cp_rank: int = 0
    """This rank's place in its context-parallel group."""

    @property
    def is_last_stage(self) -> bool:
        return self.rank == self.pp_last_rank

    @property
    def reports(self) -> bool:
        """TP rank 0 and CP rank 0 of the last stage: the rank that counts a replica's loss
        reports once (every CP rank holds them whole: `megagrpo.parallel.context_parallel`)."""
        return self.is_last_stage and self.tp_rank == 0 and self.cp_rank == 0


@dataclass(frozen=True, kw_only=True)
class Groups:
    """The process groups this rank belongs to; every collective names one of them (None
    everywhere: no process group, e.g. unit tests, where the world is this process)."""

    world: object = None
    """Every rank (pooled rollouts, run-wide agreement)."""
    tp: object = None
    """Tensor-parallel group."""
    pp: object = None
    """Pipeline group."""
    dp: object = None
    """Data-parallel group."""
    mp: object = None
    """Model-parallel (TP x PP) group: the ranks of one replica."""
    cp: object = None
    """Context-parallel group: the ranks holding chunks of the same rows."""
    replica: object = None
    """Every rank of one data replica (TP x CP x PP; the model-parallel group at cp = 1): the
    ranks that gather the replica's rollouts."""


def training_layout(parallel: ParallelConfig, model: ModelConfig, info: DistInfo
                    ) -> tuple[Ranks, Groups]:
    """This rank's `Ranks` and `Groups` from megatron's parallel_state (after
    `init_distributed`)."""
    from megatron.core import parallel_state as ps

    v_local = parallel.padded_vocab_size(model.vocab_size) // parallel.tp
    ranks = Ranks(
        rank=info.rank, dp=info.dp, dp_rank=info.dp_rank, tp_rank=info.tp_rank, pp=parallel.pp,
        pp_last_rank=ps.get_pipeline_model_parallel_last_rank(),
        mp_rank=dist.get_rank(group=ps.get_model_parallel_group()),
        mp_size=parallel.tp * parallel.pp,
        valid_local_vocab=max(0, min(v_local, model.vocab_size - info.tp_rank * v_local)),
        cp=parallel.cp, cp_rank=info.cp_rank)
    groups = Groups(world=dist.group.WORLD, tp=ps.get_tensor_model_parallel_group(),
                    pp=ps.get_pipeline_model_parallel_group(), dp=ps.get_data_parallel_group(),
                    mp=ps.get_model_parallel_group(), cp=ps.get_context_parallel_group(),
                    # pp = 1 under CP (`check_context_parallel`): a replica is TP x CP
                    replica=ps.get_model_parallel_group() if parallel.cp == 1
                    else ps.get_tensor_and_context_parallel_group())
    return ranks, groups


def any_rank(flag: bool, group=None) -> bool:
    """Collective: True when `flag` holds on any rank of `group` (the same answer on all)."""
    t = torch.tensor([1.0 if flag else 0.0])
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def tp_group():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group()


def pp_group():
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_group()


def dp_group():
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group()


def shutdown() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
