"""The weight sync's source: sharded policy -> stream of (HF name, full tensor) pairs, moved in
buckets of bounded bytes.

One code path for the vLLM weight update and the HF export. For each pipeline stage s and each
bucket of s's parameters (at most `bucket_bytes` of full tensors, or one tensor if larger):
  1. the TP ranks of stage s all-gather their shards of the bucket into one buffer (one
     collective; the buffer keeps the gathered rank-major layout),
  2. stage s broadcasts that buffer to the other stages (one collective on the PP group),
  3. every rank builds the bucket's HF tensors one parameter at a time straight from the shards
     in the buffer (QKV split per group, gate/up split, vocab padding stripped) and yields them.
Every rank of a TP x PP model-parallel group receives every tensor. Peak extra memory per rank:
one bucket buffer plus the HF tensors of one parameter; never the whole model.

`iter_vllm_slices` is the shard-to-shard variant for vLLM engines of k = training TP ranks lined
up with the training TP groups (`megagrpo.config.layout`): step 1 is skipped (a rank's shard is
its vLLM slice), step 2 moves only this TP rank's shards between the stages (its PP group), and
step 3 builds this rank's slices of the HF tensors. Only the vocab tensors are still gathered:
vLLM pads the vocab to a multiple of 64 and splits that, so its vocab slice is not a megatron
shard. `ReshardStats.received_bytes` counts what each rank received in either mode.

What is streamed is the stage's megatron parameters as given (`params`; default: the module's
own, refused when it holds parameters outside the layout, e.g. LoRA adapters): a LoRA policy's
merged view W + s B A is supplied by the LoRA side (`megagrpo.lora.layers.parameters_for_refit`;
in a `WeightSync`, the `MergeAdapters` transform), so this module knows nothing of adapters.
`FullWeights` and `ShardSlices` are the two sources a `megagrpo.sync.WeightSync` streams from;
`Feed` is one refit's stream and its counters.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megagrpo.config.model import ModelConfig, ParallelConfig
from megagrpo.engine.types import WeightSyncStats
from megagrpo.hf import ParamSpec, param_specs, save_hf_dir, slice_pairs, unfuse_shards
from megagrpo.model.gpt import DTYPE, unwrap


@dataclass
class ReshardStats:
    """Filled while the generator runs."""

    bytes: int = 0
    tensors: int = 0
    gather_s: float = 0.0
    convert_s: float = 0.0
    buckets: int = 0
    peak_buffer_bytes: int = 0
    received_bytes: int = 0
    """Bytes this rank received through TP gathers and PP broadcasts (its own shards excluded)."""


def _buckets(specs: list[ParamSpec], bucket_bytes: int, esize: int) -> list[list[ParamSpec]]:
    out, cur, size = [], [], 0
    for s in specs:
        n = esize * _numel(s.full_shape)
        if cur and size + n > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(s)
        size += n
    if cur:
        out.append(cur)
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _exported(specs: list[ParamSpec], model: ModelConfig) -> list[ParamSpec]:
    # the last stage's copy of a tied embedding is not exported (stage 0 exports it)
    tied = model.tie_word_embeddings
    return [s for s in specs if not (tied and s.local == "output_layer.weight")]


def _shards(buf: torch.Tensor, spec: ParamSpec, offset: int, n_local: int, parts: int,
            shape: tuple[int, ...]) -> list[torch.Tensor]:
    """Views of `spec`'s `parts` TP shards (of `shape`) in the buffer [parts * n_local]
    (rank-major: rank r's shards of the bucket, concatenated, at [r * n_local, (r+1) * n_local))."""
    n = _numel(shape)
    shards = [buf[r * n_local + offset: r * n_local + offset + n].view(shape)
              for r in range(parts)]
    return shards[:1] if spec.split_dim is None else shards


def _gather_in_place(buf: torch.Tensor, n_local: int, tp: int, tp_group,
                     stats: ReshardStats) -> None:
    """All-gather over TP where each rank's part already sits in its slice of `buf`. NCCL
    gathers in place with one collective; gloo's all_gather stages the whole output in a
    second buffer, so there each rank broadcasts its slice instead (tp collectives, no copy)."""
    me = dist.get_rank(tp_group)
    stats.received_bytes += (tp - 1) * n_local * buf.element_size()
    if dist.get_backend(tp_group) != "gloo":
        dist.all_gather_into_tensor(buf, buf[me * n_local:(me + 1) * n_local], group=tp_group)
        return
    for r in range(tp):
        dist.broadcast(buf[r * n_local:(r + 1) * n_local], src=dist.get_global_rank(tp_group, r),
                       group=tp_group)


@dataclass(frozen=True)
class _Step:
    """One bucket of the stream: stage `stage`'s parameters `specs`, TP-gathered or not."""

    stage: int
    specs: list[ParamSpec]
    gather: bool
    """True: every TP shard is gathered (full tensors); False: this rank's shard only."""
    ep_owner: int | None = None
    """Routed experts of expert-parallel rank `ep_owner` (every spec's): with EP > 1 that rank
    broadcasts its shards over its EP group before the TP gather; None: held by every EP rank."""


def _fill_bucket(buf: torch.Tensor, step: _Step, params: dict, my_stage: int, tp: int,
                 groups: tuple, stats: ReshardStats) -> int:
    """Brings this bucket into the front of `buf` on every rank of the model-parallel group:
    the owning stage copies its shards into its own slice (and gathers over TP in place when
    `step.gather`); the stage then broadcasts over the PP group. Without gathering, a rank's PP
    group (same TP rank on every stage) moves just that rank's shards. Returns the per-rank
    element count of the bucket."""
    tp_group, pp_group, ep_group = groups
    parts = tp if step.gather else 1
    n_local = sum(_numel(s.local_shape(tp)) for s in step.specs)
    if step.stage == my_stage:
        r = dist.get_rank(tp_group) if parts > 1 else 0
        mine = buf[r * n_local:(r + 1) * n_local]
        ep = dist.get_world_size(ep_group) if ep_group is not None and step.ep_owner is not None \
            else 1
        if ep == 1 or dist.get_rank(ep_group) == step.ep_owner:
            off = 0
            for s in step.specs:
                p = params[s.local].detach().reshape(-1)
                mine[off:off + p.numel()].copy_(p)
                off += p.numel()
        if ep > 1:  # the owner's experts to its EP peers (same TP rank, same stage)
            if dist.get_rank(ep_group) != step.ep_owner:
                stats.received_bytes += n_local * buf.element_size()
            dist.broadcast(mine, src=dist.get_global_rank(ep_group, step.ep_owner),
                           group=ep_group)
        if parts > 1:
            _gather_in_place(buf, n_local, tp, tp_group, stats)
    if dist.get_world_size(pp_group) > 1:
        if step.stage != my_stage:
            stats.received_bytes += parts * n_local * buf.element_size()
        dist.broadcast(buf[: parts * n_local], src=dist.get_global_rank(pp_group, step.stage),
                       group=pp_group)
    return n_local


def _plan(model: ModelConfig, parallel: ParallelConfig, impl: str, bucket_bytes: int,
          esize: int, slices: bool) -> list[_Step]:
    """Buckets per stage. Full tensors: buckets of at most `bucket_bytes` of full tensors, all
    gathered. Slices: buckets of at most `bucket_bytes` of this rank's shards, not gathered,
    except the vocab tensors, which are gathered whole in buckets of their own (vLLM pads and
    splits the vocab its own way, so its vocab slice is not a megatron shard)."""
    tp, steps = parallel.tp, []
    for stage in range(parallel.pp):
        specs = _exported(param_specs(model, parallel, stage, impl), model)
        if not slices:
            steps += [_Step(stage, b, True, owner) for owner, run in _owner_runs(specs)
                      for b in _buckets(run, bucket_bytes, esize)]
            continue
        vocab = [s for s in specs if s.kind == "vocab"]
        rest = [s for s in specs if s.kind != "vocab"]
        steps += [_Step(stage, [s], True) for s in vocab]
        steps += [_Step(stage, b, False, owner) for owner, run in _owner_runs(rest)
                  for b in _buckets(run, bucket_bytes * tp, esize)]
    return steps


def _owner_runs(specs: list[ParamSpec]) -> list[tuple[int | None, list[ParamSpec]]]:
    """`specs` cut into runs of one expert-parallel owner (a bucket never mixes owners)."""
    runs: list[tuple[int | None, list[ParamSpec]]] = []
    for s in specs:
        if runs and runs[-1][0] == s.ep_owner:
            runs[-1][1].append(s)
        else:
            runs.append((s.ep_owner, [s]))
    return runs


def _stream(gpt: torch.nn.Module, model: ModelConfig, parallel: ParallelConfig,
            bucket_bytes: int, stats: ReshardStats, slices: bool,
            params: Mapping[str, torch.Tensor] | None = None
            ) -> Iterator[tuple[str, torch.Tensor]]:
    from megatron.core import parallel_state as ps

    gpt = unwrap(gpt)
    my_stage = ps.get_pipeline_model_parallel_rank()
    if params is None:
        params = stage_parameters(gpt, model, parallel, my_stage)
    impl = "transformer_engine" if any("layer_norm_weight" in n for n in params) else "local"
    tp, pp = parallel.tp, parallel.pp
    groups = (ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group(),
              ps.get_expert_model_parallel_group() if parallel.ep > 1 else None)
    tp_rank = ps.get_tensor_model_parallel_rank()
    dtype = DTYPE[model.dtype]
    esize = torch.empty((), dtype=dtype).element_size()
    device = next(iter(params.values())).device
    plan = _plan(model, parallel, impl, bucket_bytes, esize, slices)

    def moves(step: _Step) -> bool:
        return pp > 1 or (tp > 1 and step.gather) or (parallel.ep > 1
                                                       and step.ep_owner is not None)

    # one receive buffer for the whole stream, reused bucket after bucket: a fresh one per
    # bucket would briefly coexist with the last (gloo frees a finished collective's tensors
    # on its own thread)
    size = max([(tp if st.gather else 1) * sum(_numel(s.local_shape(tp)) for s in st.specs)
                for st in plan if moves(st)], default=0)
    buf = torch.empty(size, dtype=dtype, device=device)
    stats.peak_buffer_bytes = size * esize
    for step in plan:
        t0 = time.perf_counter()
        move = moves(step)
        n_local = _fill_bucket(buf, step, params, my_stage, tp, groups, stats) if move else 0
        stats.gather_s += time.perf_counter() - t0
        stats.buckets += 1
        offset = 0
        for spec in step.specs:
            t1 = time.perf_counter()
            if move:
                shards = _shards(buf, spec, offset, n_local, tp if step.gather else 1,
                                 spec.local_shape(tp))
            else:  # in model.dtype like the buffer: a bf16 model keeps its norm weights in fp32
                shards = [params[spec.local].detach().to(dtype)]
            offset += _numel(spec.local_shape(tp))
            if step.gather or spec.split_dim is None:
                # views into the reused buffer are copied: the consumer may keep what it got
                pairs = [(n, t.clone() if move and _shares(t, buf) else t)
                         for n, t in unfuse_shards(shards, spec, model)]
            else:  # fresh full-shape tensors, built one at a time
                pairs = slice_pairs(shards[0], spec, model, tp_rank, stats)
            del shards
            stats.convert_s += time.perf_counter() - t1
            yield from _counted(pairs, stats)


def stage_parameters(gpt: torch.nn.Module, model: ModelConfig, parallel: ParallelConfig,
                     stage: int) -> dict[str, torch.Tensor]:
    """The stage's own named parameters, refused when it holds any the layout does not list
    (LoRA adapters: the stream would carry W without them; pass the merged view as `params`)."""
    params = dict(unwrap(gpt).named_parameters())
    impl = "transformer_engine" if any("layer_norm_weight" in n for n in params) else "local"
    extra = sorted(set(params) - {s.local for s in param_specs(model, parallel, stage, impl)})
    if extra:
        raise ValueError(f"the weight stream got parameters outside the layout: {extra[:3]}; "
                         "a LoRA policy streams through params=megagrpo.lora."
                         "parameters_for_refit(gpt) (merged) or its base (adapters off)")
    return params


def iter_hf_weights(
    gpt: torch.nn.Module,
    model: ModelConfig,
    parallel: ParallelConfig,
    *,
    params: Mapping[str, torch.Tensor] | None = None,
    bucket_bytes: int = 256 << 20,
    stats: ReshardStats | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (hf_name, full tensor) for the policy of this rank's model-parallel group.
    Collective over the TP and PP groups: every rank must drive the generator to the end.
    Tensors may be views of live parameters or of the bucket buffer: copy them if kept, never
    write to them. `params`: the stage's parameters by local name (default: `gpt`'s own,
    `stage_parameters`)."""
    stats = stats if stats is not None else ReshardStats()
    yield from _stream(gpt, model, parallel, bucket_bytes, stats, slices=False, params=params)


def iter_vllm_slices(
    gpt: torch.nn.Module,
    model: ModelConfig,
    parallel: ParallelConfig,
    *,
    params: Mapping[str, torch.Tensor] | None = None,
    bucket_bytes: int = 256 << 20,
    stats: ReshardStats | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Shard to shard, for vLLM engines whose TP equals the training TP with the ranks lined up
    (`RolloutLayout.shard_to_shard`): yields (hf_name, full-shape tensor) in which only this
    rank's vLLM TP slice is filled, built from this rank's own training shard (QKV unfused per
    KV group, gate/up split). Nothing crosses TP except the vocab tensors; pipeline stages
    broadcast only this TP rank's shards to their PP peers. Same collective contract as
    `iter_hf_weights`; the yielded tensors are fresh (or live parameters when PP = 1 for
    replicated tensors): never write to them."""
    stats = stats if stats is not None else ReshardStats()
    yield from _stream(gpt, model, parallel, bucket_bytes, stats, slices=True, params=params)


def _counted(pairs: list | Iterator, stats: ReshardStats) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields the pairs (a list is popped, so no yielded tensor stays referenced here)."""
    for name, tensor in _popped(pairs) if isinstance(pairs, list) else pairs:
        stats.bytes += tensor.numel() * tensor.element_size()
        stats.tensors += 1
        yield name, tensor
        del tensor


def _popped(pairs: list) -> Iterator:
    pairs.reverse()  # pop() from the end returns them in order
    while pairs:
        yield pairs.pop()


def _shares(t: torch.Tensor, buf: torch.Tensor) -> bool:
    return t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()


def export_hf(gpt: torch.nn.Module, out_dir: str, model: ModelConfig, parallel: ParallelConfig,
              *, params: Mapping[str, torch.Tensor] | None = None,
              bucket_bytes: int = 256 << 20) -> None:
    """Writes the sharded policy as an HF checkpoint directory (global rank 0 writes; every rank
    of the model-parallel group must call this). `params` as for `iter_hf_weights` (a LoRA
    policy: merged, `megagrpo.lora.layers.parameters_for_refit`)."""
    write = dist.get_rank() == 0 if dist.is_initialized() else True
    save_hf_dir(out_dir, model, iter_hf_weights(gpt, model, parallel, params=params,
                                                bucket_bytes=bucket_bytes), write=write)


# ---------------------------------------------------------------------- the sources
@dataclass
class Feed:
    """One refit's stream: the (HF name, tensor) pairs as the engine takes them (lazy: nothing
    is gathered until they are pulled) and the counters the source fills while they are."""

    pairs: Iterator[tuple[str, torch.Tensor]]
    stats: ReshardStats = field(default_factory=ReshardStats)
    dtypes: Mapping[str, torch.dtype] | None = None
    """What the pairs are declared to be, name by name (`WeightSync.expects`: the layout plus
    each transform's declaration); the engine's feed refuses a tensor that differs."""

    def gather_metrics(self) -> dict:
        """What producing the pairs moved and cost (once they were all pulled)."""
        return {"sync_bytes": self.stats.bytes, "sync_received_bytes": self.stats.received_bytes,
                "sync_gather_s": self.stats.gather_s}

    def metrics(self, load: WeightSyncStats) -> dict:
        """The step's sync metrics after an engine consumed the pairs in `load` (vLLM's own
        time: the whole update less the gather and the conversion it pulled)."""
        return dict(self.gather_metrics(),
                    sync_load_s=load.seconds - self.stats.gather_s - self.stats.convert_s)


@dataclass(frozen=True)
class FullWeights:
    """Full HF tensors (TP gathered, PP broadcast, unfused), every rank of a model-parallel
    group receiving all of them: engines of another TP than training's, the HF export, a
    rollout rank's send."""

    model: ModelConfig
    parallel: ParallelConfig
    bucket_bytes: int = 256 << 20

    def feed(self, policy: torch.nn.Module, params: Mapping[str, torch.Tensor] | None) -> Feed:
        """The stream of `policy`'s stage (`params`: its parameters by local name; None: the
        module's own, `stage_parameters`)."""
        out = Feed(iter(()))
        out.pairs = iter_hf_weights(policy, self.model, self.parallel, params=params,
                                    bucket_bytes=self.bucket_bytes, stats=out.stats)
        return out

    def refit(self, policy: torch.nn.Module, feed: Callable[[], Feed],
              deliver: Callable[[Feed], dict]) -> dict:
        """One refit: the whole stream through the transport (`deliver`)."""
        return deliver(feed())

    def base_changed(self) -> None:
        """Nothing to remember: every refit streams the whole policy."""

    def checkpoint_parts(self) -> dict:
        return {}


@dataclass(frozen=True)
class OwnShards(FullWeights):
    """This rank's own megatron shards by local name, nothing gathered or converted (the
    pairs are the stage's live parameters, or the transforms' view of them): what the
    `shards` transport sends to rollout ranks of their own (`megagrpo.engine.shard_feed`)."""

    def feed(self, policy: torch.nn.Module, params: Mapping[str, torch.Tensor] | None) -> Feed:
        from megatron.core import parallel_state as ps

        stage = ps.get_pipeline_model_parallel_rank()
        if params is None:
            params = stage_parameters(policy, self.model, self.parallel, stage)
        impl = "transformer_engine" if any("layer_norm_weight" in n for n in params) else "local"
        specs = _exported(param_specs(self.model, self.parallel, stage, impl), self.model)
        out = Feed(iter(()))
        out.pairs = _counted([(s.local, params[s.local]) for s in specs], out.stats)
        return out


@dataclass(frozen=True)
class ShardSlices(FullWeights):
    """Shard to shard: each rank's own vLLM slice of every tensor (`iter_vllm_slices`), for
    engines of k = training TP ranks lined up with the training TP groups."""

    def feed(self, policy: torch.nn.Module, params: Mapping[str, torch.Tensor] | None) -> Feed:
        out = Feed(iter(()))
        out.pairs = iter_vllm_slices(policy, self.model, self.parallel, params=params,
                                     bucket_bytes=self.bucket_bytes, stats=out.stats)
        return out
