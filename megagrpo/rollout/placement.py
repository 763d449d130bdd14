"""Separate placement (rollout.placement=separate): one torchrun world of T training ranks
followed by R rollout ranks, each rollout rank running a vLLM engine of its own.

The world is split before megatron-core starts (`split_world`):
  - training ranks 0..T-1 open their default process group over a prefix of torchrun's store with
    world size T, so megatron-core's parallel_state (which builds every group from the default
    one) sees the T training ranks only and TP x PP x DP = T;
  - rollout ranks T..T+R-1 open theirs (world R, each engine TP 1) the same way, so vLLM finds an
    initialised default group of rollout ranks only;
  - a gloo group `cross` of training rank 0 and the R rollout ranks is built directly on a third
    prefix of the store (a raw `ProcessGroupGloo`, registered nowhere): the weights go over it.

What flows where:
  - weights: after every optimizer step each training rank of DP replica 0 sends its own
    shards, bucketed, point to point to every rollout rank over the whole-world `weights` group,
    and each rollout rank reassembles the HF tensors (`sync.transport=shards`,
    `megagrpo.sync.transports.shards`, `megagrpo.engine.shard_feed`); with expert parallelism the
    training ranks drive the colocated refit's stream instead (TP gather, PP broadcast, HF names)
    and training rank 0 broadcasts the full tensors over `cross` (`collective`). Either way
    training rank 0 announces each numbered sync in the store and broadcasts its header over
    `cross` first (`RemoteEngine.begin_sync`), and every rollout rank loads the tensors into its
    engine (`receive_weights`).
  - completions: rollout rank j samples prompts j, j+R, ... of every global batch (groups whole,
    from a PromptLoader of the whole batch that starts where the trainer's stands), scores them,
    stamps them with the sync they were sampled by, and sends them as packed tensors over the
    `samples` gloo group of the whole world (`megagrpo.rollout.sample_channel.TensorChannel`: each
    training rank receives its DP replica's contiguous slice of the batch from every rollout
    rank, when it asks for batch i; `SeparateSource.next`).
  - staleness: a rollout rank samples batch i only with a sync >= i - k (k =
    rollout.max_staleness), taking every newer announced sync between batches, so a sample is at
    most k syncs (hence at most k optimizer updates) older than the step that trains it. k = 0 is
    a synchronous hand-off: batch i waits for the weights the step that trains it starts from.
    The last batch of a launch (`RemoteEngine.batches`, told at the first sync) is drawn at
    k = 0 whatever k is: the run ends on-policy, and its vLLM-vs-trainer gap checks the
    weights that crossed the wire after every sync.
  - dynamic sampling (algo.dynamic_sampling): training rank 0 asks for each top-up of a step
    in the store (`topup/{n}`) and the training ranks take the stream's next batch; the
    rollout ranks count the top-ups asked for, so the staleness rule above reads the step a
    draw belongs to (draws less top-ups), not the draw's index in the stream.
  - in-flight updates (rollout.inflight_updates): a rollout rank's engine generates on a
    thread while its main thread keeps receiving the syncs the trainer sends and posts each to
    the engine's in-flight slot (`megagrpo.engine.inflight`), which loads the newest between
    two decode steps, KV cache kept; vLLM stamps every token with the sync that sampled it, and
    the trainer maps sync indices to policy versions (`Completion.token_versions`). The
    trainer's broadcast then never waits for a draw to end.
  - held-out evaluation: training rank 0 announces evaluation e in the store and broadcasts
    its header (how many examples, a digest of their prompts) over `cross`, between two syncs;
    rollout rank j evaluates examples j, j+R, ... of its own copy of the held-out set, greedy,
    with the weights of every sync sent before it, and puts (correct, counted) in the store,
    where every training rank reads all of them (`RemoteEngine.request_eval`,
    `SeparateSource.evaluate`). An evaluation carries no weights and takes no sync index, so
    the staleness bound counts weight syncs only.
  - cold start: its syncs carry no start (`RemoteEngine.held`): the rollout ranks load them
    and serve the evaluations but draw nothing until the trainer's release after the cold
    start, which carries the start; batch i then needs sync base + i - k, base the last sync
    before the release.
  - resume: the trainer's own PromptLoader tracks the next untrained batch and is checkpointed as
    in colocated runs; the first sync of a run tells the rollout ranks where to start. As a
    checkpoint is written, training rank 0 asks every rollout rank for its in-flight state (the
    finished parts the trainer has not taken, the sampler's streams and loader position of its
    next draw; `save_in_flight`), which goes into the same checkpoint (`InFlightState`); a
    resumed launch sends it back with its first sync (`restore_in_flight`), so the run goes on
    bitwise as if uninterrupted. Without it (another number of rollout ranks or another k) the
    batches sampled ahead are sampled again, by the restored weights, from the same prompts
    (no prompt lost or trained twice; not bitwise).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Protocol

import torch
import torch.distributed as dist

from megagrpo.config.lora import LoRAConfig
from megagrpo.config.model import ModelConfig, ParallelConfig
from megagrpo.config.placement import training_world
from megagrpo.engine.process import EngineLost
from megagrpo.engine.shard_feed import received_tensors as received_shards
from megagrpo.lora.export import save_peft_adapter
from megagrpo.rollout.collect import dynamic_sampling
from megagrpo.rollout.sample_channel import Part, TensorChannel, merged, pack, unpack
from megagrpo.rollout.stream import StreamStats, stamp
from megagrpo.runtime.distributed import process_group_backend

if TYPE_CHECKING:
    from megagrpo.config.train import TrainConfig
    from megagrpo.data import PromptLoader
    from megagrpo.rollout.collect import RolloutCollector
    from megagrpo.rollout.stream import Rollout
    from megagrpo.runtime.distributed import Groups, Ranks

log = logging.getLogger("megagrpo")

WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TAG_STATE = 1
"""The samples group's tag of a rollout rank's in-flight state (to and from training rank 0);
the finished parts travel under the sample channel's tag 0."""


# ---------------------------------------------------------------------- the world split
@dataclass
class Placement:
    """This process's side of a separate-placement world."""

    rank: int
    """Global (torchrun) rank."""
    train_world: int
    """T: ranks 0..T-1 train."""
    rollout_ranks: int
    """R: ranks T..T+R-1 run an engine each."""
    store: object
    """torchrun's store under this run's prefix: sync announcements and finished batches."""
    cross: object | None
    """Gloo group of training rank 0 (cross rank 0) and rollout rank j (cross rank 1 + j);
    None on the other training ranks."""
    timeout_s: float
    """How long a wait for weights or a batch may take (parallel.collective_timeout_s)."""
    samples: object | None = None
    """Gloo group of the whole world (ranks as in torchrun): the finished samples travel over
    it (`megagrpo.rollout.sample_channel.TensorChannel`)."""
    weights: object | None = None
    """sync.transport=shards: gloo group of the whole world the training ranks' shards travel
    over (`megagrpo.engine.shard_feed`); None otherwise."""
    model: ModelConfig | None = None
    """The policy's architecture (a rollout rank reassembles shards by it)."""
    parallel: ParallelConfig | None = None
    """The training layout (whose shards a rollout rank receives)."""
    lora: LoRAConfig | None = None
    """A LoRA run's adapters (a rollout rank writes each adapter-only sync as a peft folder)."""
    adapter_dir: Path | None = None
    """Rollout rank: where it writes those folders (its engine's folder)."""
    engine_tp: int = 1
    """rollout.tensor_parallel_size: rollout rank j is vLLM TP rank j % engine_tp of engine
    j // engine_tp (`engine_layout`)."""
    engine_group: object | None = None
    """Rollout rank of an engine of engine_tp > 1 ranks: a gloo group of that engine's ranks
    (engine rank 0 tells the others when to take a sync, `_agree`); None otherwise."""
    received_bytes: int = 0
    """Rollout rank: the weight bytes the shards transport brought it (every sync)."""
    failover: bool = False
    """rollout.engine_failure=continue: a rollout rank whose engine failed reports itself out
    and the others make up its share of each batch (`serve`, `TensorChannel.take`)."""

    def channel(self, batch_size: int, replica: tuple[int, int] | None = None
                ) -> TensorChannel:
        """This rank's end of the sample channel; `replica` = (dp_rank, dp) on training ranks."""
        return TensorChannel(group=self.samples, store=self.store, rank=self.rank,
                             train_world=self.train_world, rollout_ranks=self.rollout_ranks,
                             batch_size=batch_size, timeout_s=self.timeout_s, replica=replica,
                             failover=self.failover)

    @property
    def is_rollout(self) -> bool:
        return self.rank >= self.train_world

    @property
    def rollout_index(self) -> int:
        """j: this rollout rank's index among the rollout ranks."""
        return self.rank - self.train_world

    @property
    def engine_index(self) -> int:
        """e: this rollout rank's engine (rollout ranks e*k .. e*k+k-1, k = engine_tp)."""
        return self.rollout_index // self.engine_tp

    @property
    def engine_rank(self) -> int:
        """This rollout rank's vLLM TP rank in its engine (0: the leader, which reports)."""
        return self.rollout_index % self.engine_tp

    @property
    def engines(self) -> int:
        """E: the rollout ranks' engines (R / k)."""
        return self.rollout_ranks // self.engine_tp

    def announce(self, sync: int) -> None:
        """Training rank 0: sync `sync` is about to be broadcast."""
        self.store.set(f"sync/{sync}", "1")

    def announced(self, sync: int) -> bool:
        return self.store.check([f"sync/{sync}"])

    def eval_asked(self, e: int) -> bool:
        """Whether training rank 0 has asked for held-out evaluation `e`."""
        return self.store.check([f"eval/{e}"])

    def checkpoint_asked(self, c: int) -> bool:
        """Whether training rank 0 has asked for the in-flight state of checkpoint `c`."""
        return self.store.check([f"ckpt/{c}"])

    def describe(self, cfg: TrainConfig, dp: int) -> str:
        """The console line that says where each rank went."""
        p, T, R = cfg.parallel, self.train_world, self.rollout_ranks
        how = ", loaded between decode steps (in flight)" if cfg.rollout.inflight_updates else ""
        ep = f" x ep={p.ep}" if p.ep > 1 else ""
        how_sent = ("each training rank's own shards, reassembled on the rollout ranks"
                    if cfg.sync.resolved(cfg.rollout, p) == "shards"
                    else "full tensors from rank 0")
        k = self.engine_tp
        engines = ("one vLLM engine of TP 1 each" if k == 1 else
                   f"{R // k} vLLM engine(s) of TP {k}, each over {k} consecutive rollout ranks")
        if k > 1 and how_sent.startswith("each training rank's own shards"):
            how_sent = ("each training TP rank's own shards to the engine ranks of its TP rank "
                        "(the vocab tensors whole to all)" if p.tp == k else
                        "each training rank's own shards, reassembled whole on every rollout "
                        "rank (training TP != rollout TP; vLLM slices them)")
        return (f"placement: separate; training ranks 0-{T - 1} (megatron-core tp={p.tp} x "
                f"pp={p.pp} x dp={dp}{ep}), rollout ranks {T}-{T + R - 1} ({engines}, "
                f"{cfg.rollout.dtype}); weights as {how_sent}, over gloo in "
                f"buckets of <= {cfg.rollout.sync_bucket_mb} MiB after every step; samples as "
                "packed tensors over gloo"
                f"{how}"
                f"; samples at most {cfg.staleness} version(s) old")


def split_world(cfg: TrainConfig, rank: int, world: int, model: ModelConfig | None = None
                ) -> Placement:
    """Collective over the whole torchrun world: opens this rank's default process group (the
    training ranks', or the rollout ranks'), the cross group, the samples group and, for
    sync.transport=shards, the weights group (module docstring). `model`: the policy's
    architecture as the preflight resolved it."""
    T, R = training_world(cfg.rollout, world), cfg.rollout.rollout_ranks
    timeout = timedelta(seconds=cfg.parallel.collective_timeout_s)
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world, timeout=timeout))
    # a restarted torchrun keeps its store: keys of an earlier attempt must not be read
    store = dist.PrefixStore(f"megagrpo/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/",
                             store)
    rollout = rank >= T
    backend = process_group_backend(cfg.parallel.backend, torch.cuda.is_available())
    dist.init_process_group(backend, store=dist.PrefixStore("rollout/" if rollout else "train/",
                                                            store),
                            rank=rank - T if rollout else rank, world_size=R if rollout else T,
                            timeout=timeout)
    cross = None
    if rank == 0 or rollout:
        cross = dist.ProcessGroupGloo(dist.PrefixStore("cross/", store),
                                      rank - T + 1 if rollout else 0, R + 1, timeout)
    samples = dist.ProcessGroupGloo(dist.PrefixStore("samples/", store), rank, T + R, timeout)
    weights = None
    if cfg.sync.resolved(cfg.rollout, cfg.parallel) == "shards":
        weights = dist.ProcessGroupGloo(dist.PrefixStore("weights/", store), rank, T + R,
                                        timeout)
    k = cfg.rollout.tensor_parallel_size
    engine_group = None
    if rollout and k > 1:  # a raw group per engine: only its own ranks build it
        engine_group = dist.ProcessGroupGloo(dist.PrefixStore(f"engine/{(rank - T) // k}/",
                                                              store), (rank - T) % k, k, timeout)
    return Placement(rank=rank, train_world=T, rollout_ranks=R, store=dist.PrefixStore(
        "stream/", store), cross=cross, timeout_s=cfg.parallel.collective_timeout_s,
        samples=samples, weights=weights, model=model or cfg.model, parallel=cfg.parallel,
        lora=cfg.lora, adapter_dir=Path(cfg.run.out_dir) / "engine" / f"rank{rank}" / "adapters",
        engine_tp=k, engine_group=engine_group,
        failover=cfg.rollout.engine_failure == "continue")


# ---------------------------------------------------------------------- the wire
def streams_weights(parallel) -> bool:
    """Whether this training rank takes part in the weight stream of a separate-placement sync:
    the ranks of one data-parallel replica (the stream gathers over TP and PP), and with expert
    parallelism every rank of that replica's expert groups (EP is carved out of DP: the experts
    of replica 0 live on ranks of other DP ranks, whose gathers must run too)."""
    from megatron.core import parallel_state as ps

    if parallel.ep > 1:
        return ps.get_expert_data_parallel_rank() == 0
    return ps.get_data_parallel_rank() == 0


def bcast_json(pg, obj: object | None) -> dict:
    """Broadcasts a JSON-able object from cross rank 0 (`obj` there, None elsewhere)."""
    data = json.dumps(obj).encode() if obj is not None else b""
    n = torch.tensor([len(data)], dtype=torch.int64)
    pg.broadcast(n, 0).wait()
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data
           else torch.empty(int(n.item()), dtype=torch.uint8))
    pg.broadcast(buf, 0).wait()
    return json.loads(buf.numpy().tobytes().decode())


@dataclass
class RemoteEngine:
    """The trainer's stand-in for an engine under separate placement: the weight sync's
    `collective` transport sends the policy to the rollout ranks through it
    (`megagrpo.sync.transports.collective`); `close` tells them to stop."""

    place: Placement
    loader: PromptLoader
    """The trainer's loader: its position at the first sync is where the rollout ranks start."""
    sends: bool
    """This rank takes part in the stream (`streams_weights`; the others skip it); rank 0
    broadcasts."""
    bucket_bytes: int
    dtype: str
    syncs: int = 0
    """Syncs sent in this launch (the next one's index)."""
    evals: int = 0
    """Held-out evaluations asked for in this launch (the next one's index)."""
    held: bool = False
    """A cold start runs before GRPO: the syncs carry no start (the rollout ranks load the
    weights and evaluate, but draw nothing) until `release`."""
    max_lora_rank: int = 0
    batches: int | None = None
    """The batches this launch will take (run.steps less the steps a resume restored; set
    before the first sync, which tells the rollout ranks): the last one is drawn on-policy,
    with the weights of the step that trains it (k = 0), whatever rollout.max_staleness is."""
    checkpoints: int = 0
    """Checkpoints of the rollout ranks' in-flight state asked for in this launch."""
    restore: list[dict] | None = None
    """Training rank 0 of a resumed launch: each rollout rank's in-flight state from the
    checkpoint (`InFlightState`), sent with the first sync."""

    @staticmethod
    def of(engine: object, transport: str) -> RemoteEngine:
        """`engine` as the rollout ranks' stand-in, for the weight sync `transport` that sends
        to them; refused where the rollout is colocated (no rollout ranks to send to)."""
        if not isinstance(engine, RemoteEngine):
            raise ValueError(f"sync.transport={transport} sends to rollout ranks: it needs "
                             "rollout.placement=separate; set sync.transport=auto")
        return engine

    def begin_sync(self, via: str, **head) -> int:
        """Every training rank, at the start of a sync: its index; training rank 0 announces
        it and broadcasts its header over the cross group (`via`: the transport whose tensors
        follow, so the rollout ranks know how to receive them; `head`: more of the header,
        e.g. an adapter-only LoRA sync's `adapter` and `base`, `receive_weights`)."""
        sync, self.syncs = self.syncs, self.syncs + 1
        if self.sends and self.place.cross is not None:
            first = sync == 0 and not self.held
            self.place.announce(sync)
            resume = first and self.restore is not None
            bcast_json(self.place.cross, {"sync": sync, "stop": False, "via": via,
                                          "start": self.loader.state_dict() if first else None,
                                          "batches": self.batches if first else None,
                                          "resume": resume, **head})
            if resume:  # before the weights: each rollout rank reads it after the header
                for j, state in enumerate(self.restore):
                    send_state(self.place.samples, self.place.train_world + j, state)
                self.restore = None
        return sync

    def request_checkpoint(self, taken: int, versions: dict[int, int]) -> int:
        """Training rank 0: asks the rollout ranks for their in-flight state (`taken`: the
        batches this launch trained; `versions`: sync index -> policy version); the index."""
        c, self.checkpoints = self.checkpoints, self.checkpoints + 1
        self.place.store.set(f"ckpt/{c}", "1")
        bcast_json(self.place.cross, {"checkpoint": {"index": c, "taken": taken,
                                                     "batches": self.batches,
                                                     "versions": versions}, "stop": False})
        return c

    def release(self) -> None:
        """Every training rank, after a cold start (`held`): the rollout ranks start drawing
        GRPO's batches, with the weights of the last sync or newer (training rank 0 broadcasts
        the start: the loader position and the batches this launch takes)."""
        if not self.held:
            return
        self.held = False
        if self.place.cross is not None:
            bcast_json(self.place.cross, {"release": True, "stop": False,
                                          "start": self.loader.state_dict(),
                                          "batches": self.batches})

    def request_eval(self, examples) -> int:
        """Every training rank: the index of a held-out evaluation of `examples` by the
        rollout ranks' engines; training rank 0 announces it and broadcasts its header."""
        e, self.evals = self.evals, self.evals + 1
        if self.place.cross is not None:
            self.place.store.set(f"eval/{e}", "1")
            bcast_json(self.place.cross, {"eval": {"index": e, "n": len(examples),
                                                   "digest": eval_digest(examples)},
                                          "stop": False})
        return e

    def close(self) -> None:
        """End of run: the rollout ranks stop after the batch they are sampling."""
        if self.place.cross is not None:
            self.place.announce(self.syncs)
            bcast_json(self.place.cross, {"sync": self.syncs, "start": None, "stop": True})

    def rng_state(self) -> dict:
        return {}  # the samplers live on the rollout ranks (their state: `InFlightState`)

    def set_rng_state(self, state: dict) -> None:
        pass

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass


@dataclass
class Sync:
    """A sync a rollout rank received."""

    index: int
    start: dict | None
    """The trainer's loader position at the first sync (where sampling starts)."""
    stop: bool
    batches: int | None = None
    """The first sync: the batches the trainer will take in this launch (None: unknown)."""
    eval: dict | None = None
    """Not a sync: a held-out evaluation asked for (index, n, digest); no weights."""
    release: bool = False
    """Not a sync: the end of a cold start (`start` and `batches` set); no weights."""
    checkpoint: dict | None = None
    """Not a sync: the trainer checkpoints (index, taken, batches, versions); no weights."""
    restore: dict | None = None
    """The first sync of a resumed launch: this rollout rank's in-flight state from the
    checkpoint (`save_in_flight`)."""


def eval_digest(examples) -> str:
    """A short digest of held-out examples' prompts and answers (both sides must evaluate the
    same set)."""
    text = json.dumps([[e.prompt, e.answer] for e in examples], default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def receive_weights(place: Placement, engine) -> Sync:
    """Rollout rank: the next message from the cross group: a sync, loaded into `engine`, a
    stop message or an evaluation request (neither carries weights). With in-flight updates
    the engine's weights are labelled with the sync's index, which vLLM stamps on the tokens
    they sample."""
    head = bcast_json(place.cross, None)
    if head.get("eval") is not None:
        return Sync(index=-1, start=None, stop=False, eval=head["eval"])
    if head.get("checkpoint") is not None:
        return Sync(index=-1, start=None, stop=False, checkpoint=head["checkpoint"])
    if head.get("release"):
        return Sync(index=-1, start=head["start"], stop=False, batches=head["batches"],
                    release=True)
    sync = Sync(index=head["sync"], start=head["start"], stop=head["stop"],
                batches=head.get("batches"))
    if head.get("resume"):
        sync.restore = receive_state(place.samples, 0)
    if sync.stop:
        return sync
    if head.get("adapter"):
        receive_adapter(place, engine, head)
        return sync
    engine.update_weights(_incoming(place, head), **_partial(head))
    if getattr(engine, "inflight", None) is not None:
        engine.inflight.label(engine, sync.index)
    return sync


def _partial(head: dict) -> dict:
    """update_weights' arguments for a sync: a delta (rollout.sync_delta) updates a subset."""
    return {"partial": True} if head.get("delta") else {}


def receive_adapter(place: Placement, engine, head: dict) -> None:
    """Rollout rank, an adapter-only LoRA sync (`megagrpo.sync.adapters.AdapterSource`): the
    base as its transport sent it when the header says it changed (`base`; after a merge),
    then the adapter tensors broadcast over the cross group, written as a peft folder the
    engine loads as its next adapter. Logs the bytes of both."""
    base = (engine.update_weights(_incoming(place, head), **_partial(head)).bytes
            if head.get("base") else 0)
    tensors = {n: t.clone() for n, t in _received_tensors(place.cross)}  # own storage each
    folder = place.adapter_dir / f"adapter_{head['sync']}"
    save_peft_adapter(folder, tensors, place.lora, base="")
    engine.load_adapter(str(folder))
    shutil.rmtree(place.adapter_dir / f"adapter_{head['sync'] - 1}", ignore_errors=True)
    log.info("rollout rank %d: adapter sync %d received %d bytes of the base and %d of the "
             "adapters", place.rank, head["sync"], base,
             sum(t.numel() * t.element_size() for t in tensors.values()))


def receive_posted(place: Placement, engine) -> Sync:
    """Rollout rank, while its engine generates on another thread (rollout.inflight_updates):
    the next sync from the cross group, materialised and posted to the engine's in-flight slot
    labelled with its index; the generating thread loads it between two decode steps."""
    head = bcast_json(place.cross, None)
    sync = Sync(index=head["sync"], start=head["start"], stop=head["stop"])
    if not sync.stop:
        engine.inflight.post(list(_incoming(place, head)), sync.index)
    return sync


def _incoming(place: Placement, head: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of the sync whose header is `head`, as the transport it names sent them:
    `shards` (each training rank's own shards, reassembled here) or `collective`."""
    if head.get("via") == "shards":
        return received_shards(place.weights, place.store, place.model, place.parallel,
                               place.engine_tp, place.engine_rank, counts=place)
    return _received_tensors(place.cross)


def _received_tensors(pg) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs of one sync, bucket by bucket; each bucket a fresh buffer (vLLM
    may hold a tensor until its layer is complete)."""
    while True:
        head = bcast_json(pg, None)
        if head.get("end"):
            return
        shapes = [torch.Size(s) for s in head["shapes"]]
        flat = torch.empty(sum(s.numel() for s in shapes), dtype=WIRE_DTYPES[head["dtype"]])
        pg.broadcast(flat, 0).wait()
        off = 0
        for name, shape in zip(head["names"], shapes):
            yield name, flat[off:off + shape.numel()].view(shape)
            off += shape.numel()


# ---------------------------------------------------------------------- the rollout ranks
def serve(cfg: TrainConfig, place: Placement, collector: RolloutCollector, watchdog,
          held_out: list | None = None) -> dict:
    """A rollout rank's whole run: sample batch after batch with the newest weights it has
    (at least sync i - k for batch i), put each finished part in the store, and evaluate
    `held_out` (its share, greedy) whenever the trainer asks, until the trainer says stop.
    Returns what it did."""
    k, B = cfg.staleness, cfg.data.batch_size
    loader = collector.loader
    watchdog.set_phase("weight_sync", 0)  # phases name a stall, as on the training ranks
    sync, evals = _until_started(place, collector, held_out or [], watchdog)
    if sync.start is not None:
        loader.load_state_dict(sync.start)
    last = sync.batches - 1 if sync.batches is not None else None
    base = sync.index  # batch i: sync base + i - k or newer (base > 0 after a cold start)
    # groups whole: every sample of a prompt on one engine (all of whose ranks draw it)
    mine = list(range(place.engine_index, B, place.engines))
    channel = place.channel(B)
    i, ckpts, starts = 0, 0, {}  # starts: batch -> (sampler state, loader) before its draw
    if sync.restore is not None:  # a resumed launch: the checkpoint's queued parts first
        i = restore_in_flight(collector, channel, sync.restore)
    topups = 0
    makeups = MakeUps(place) if place.failover else None
    while not sync.stop:
        if makeups is not None:  # rollout.engine_failure=continue
            makeups.check_engine(collector.engine, i)
            if makeups.serve(collector, channel, starts, i, sync):
                continue
        # an engine's ranks count the same top-ups: its leader's count
        topups = _leaders(place, _topups_asked(place, topups))
        step = i - topups  # the trainer's step the next draw goes to (top-ups: part of theirs)
        # at most k syncs behind; the launch's last batch on-policy (k = 0)
        behind = sync.index < base + step - (0 if step == last else k)
        behind = behind or (makeups is not None and makeups.out)  # an out rank draws nothing
        due = (sync, evals, ckpts)  # the messages a broadcast may be on its way for
        if behind and cfg.algo.dynamic_sampling and not _agree(place, _message_due(place, *due)):
            watchdog.set_phase("weight_sync", i)  # or a top-up of this step, asked first
            if place.engine_rank == 0:  # its peers wait for the count it sends next round
                _await_topup_or_message(place, due, topups)
            continue
        if behind and makeups is not None and not _message_due(place, *due):
            watchdog.set_phase("weight_sync", i)  # polled: a make-up may be asked meanwhile
            time.sleep(0.005)
            continue
        # an engine's ranks take the same syncs at the same point (its leader decides)
        if _agree(place, behind or _message_due(place, *due)):
            watchdog.set_phase("weight_sync", i)
            got = receive_weights(place, collector.engine)
            if got.eval is not None:  # with the weights of every sync sent before it
                try:
                    evals = _evaluate(place, collector, got.eval, held_out or [], watchdog,
                                      out=makeups is not None and makeups.out)
                except EngineLost as e:  # its share is not evaluated
                    if makeups is None:
                        raise
                    makeups.report(e, i)
                    evals = _evaluate(place, collector, got.eval, held_out or [], watchdog,
                                      out=True)
            elif got.checkpoint is not None:
                if makeups is not None:  # its state is the streams of a live engine only
                    makeups.check_engine(collector.engine, i)
                try:
                    ckpts = save_in_flight(place, collector, channel, got.checkpoint, starts,
                                           i, topups, out=makeups is not None and makeups.out)
                except EngineLost as e:  # died since: nothing was sent yet
                    if makeups is None:
                        raise
                    makeups.report(e, i)
                    ckpts = save_in_flight(place, collector, channel, got.checkpoint, starts,
                                           i, topups, out=True)
            else:
                sync = got
            continue
        watchdog.set_phase("rollout", i)
        try:
            sync = _draw(place, collector, channel, sync, starts, i, mine)
        except EngineLost as e:
            if makeups is None:
                raise
            makeups.report(e, i)  # out from batch i: the trainer has its share made up
            continue
        for old in [b for b in starts if b < i - k - 4]:  # the trainer took them long ago
            del starts[old]
        i += 1
    channel.close()
    return {"batches": i, "syncs": sync.index, "sample_bytes": channel.bytes_sent,
            "evaluations": evals, "weight_bytes_received": place.received_bytes}


def _draw(place: Placement, collector: RolloutCollector, channel: TensorChannel, sync: Sync,
          starts: dict[int, tuple], i: int, mine: list[int]) -> Sync:
    """Rollout rank: draws prompts `mine` of batch i (the loader's next), with the engine's
    weights (and, in flight or with partial rollouts, every sync announced meanwhile), and
    puts the part in the channel; `starts[i]`: the sampler's streams and the loader position
    before it. Returns the newest sync."""
    cfg, loader, t0 = collector.cfg, collector.loader, time.perf_counter()
    before = loader.state_dict()
    starts[i] = (collector.engine.rng_state(), before)
    examples = next(loader)
    prompts = [_encode(collector.tokenizer, e.prompt) for e in examples]
    args = (prompts, [e.answer for e in examples], mine, collector.sampling(),
            [e.record for e in examples], [e.prompt for e in examples])
    first = sync
    if cfg.rollout.partial_rollouts:  # paused at each announced sync, continued after it
        (comps, rewards, metrics), sync = _generate_partial(place, collector, args, sync)
    elif getattr(collector.engine, "inflight", None) is None:
        comps, rewards, metrics = collector._generate(*args)
    else:
        (comps, rewards, metrics), sync = _generate_inflight(place, collector, args, sync)
    stamp(comps, first.index)  # sync indices (per token in flight); the trainer maps them
    leads = place.engine_rank == 0  # an engine's other ranks drew the same: they send none
    channel.put(Part(batch=i, rollout=place.rollout_index, loader=before, epoch=loader.epoch,
                     draw_s=time.perf_counter() - t0, metrics=metrics if leads else {},
                     completions=comps if leads else [],
                     rewards=rewards.tolist() if leads else []))
    return sync


@dataclass
class MakeUps:
    """A rollout rank's side of rollout.engine_failure=continue: it reports itself out when its
    engine fails (`report`; the store's `out/{j}`: the first batch it did not draw), and it
    draws the shares of failed ranks that training rank 0 asks it to make up (`makeup/{m}`),
    each from the prompts of that batch, once it has drawn its own part of it."""

    place: Placement
    out: bool = False
    seen: int = 0
    """Make-up requests read from the store so far (every rank reads them all)."""
    asked: list = field(default_factory=list)
    """Requests addressed to this rank, not drawn yet: (batch, slot)."""

    def check_engine(self, engine, i: int) -> None:
        """Reports the rank out once its engine was lost outside a draw (e.g. in a sync, whose
        tensors it then drained)."""
        alive = getattr(engine, "alive", None)
        if alive is not None and not alive() and not self.out:
            self.report(engine.lost, i)

    def report(self, lost: EngineLost, i: int) -> None:
        self.out = True
        self.place.store.set(f"out/{self.place.rollout_index}", json.dumps(
            {"batch": i, "pid": lost.pid, "how": lost.how}))
        log.warning("rollout rank %d: %s at batch %d; it draws no more and keeps taking the "
                    "trainer's syncs (rollout.engine_failure=continue)", self.place.rank, lost,
                    i)

    def serve(self, collector: RolloutCollector, channel: TensorChannel,
              starts: dict[int, tuple], i: int, sync: Sync) -> bool:
        """Draws one make-up asked of this rank whose batch it has drawn (< i); whether it did.
        The make-up uses the engine's newest weights (at least as new as the batch needs) and
        is put after this rank's own part of that batch (the order the trainer receives)."""
        store, j = self.place.store, self.place.rollout_index
        while store.check([f"makeup/{self.seen}"]):
            ask = json.loads(store.get(f"makeup/{self.seen}"))
            self.seen += 1
            if ask["by"] == j:
                self.asked.append((ask["batch"], ask["slot"]))
        ready = [a for a in self.asked if a[0] < i]
        if self.out or not ready:
            return False
        b, slot = ready[0]
        self.asked.remove(ready[0])
        if b not in starts:
            raise RuntimeError(f"rollout rank {self.place.rank}: asked to make up rollout rank "
                               f"{self.place.train_world + slot}'s share of batch {b}, which it "
                               "drew too long ago")
        loader, t0 = collector.loader, time.perf_counter()
        here, before = loader.state_dict(), starts[b][1]
        loader.load_state_dict(before)
        examples = next(loader)
        loader.load_state_dict(here)
        mine = list(range(slot, collector.cfg.data.batch_size, self.place.engines))
        args = ([_encode(collector.tokenizer, e.prompt) for e in examples],
                [e.answer for e in examples], mine, collector.sampling(),
                [e.record for e in examples], [e.prompt for e in examples])
        try:
            comps, rewards, metrics = collector._generate(*args)
        except EngineLost as e:
            self.report(e, i)
            return True
        stamp(comps, sync.index)
        channel.put(Part(batch=b, rollout=slot, loader=before, epoch=before["epoch"],
                         draw_s=time.perf_counter() - t0, metrics=metrics, completions=comps,
                         rewards=rewards.tolist(), by=j))
        log.info("rollout rank %d: made up rollout rank %d's share of batch %d (%d prompts)",
                 self.place.rank, self.place.train_world + slot, b, len(mine))
        return True


def _agree(place: Placement, flag: bool) -> bool:
    """`flag` as the leader of this rollout rank's engine sees it (engines of one rank: as
    is). The ranks of an engine of TP > 1 run vLLM's collectives together: they must take a
    sync (or draw) at the same point, and store checks made on each rank could differ."""
    return bool(_leaders(place, int(flag)))


def _leaders(place: Placement, value: int) -> int:
    """`value` as the leader of this rollout rank's engine has it (engines of one rank: as
    is); collective over the engine's ranks."""
    if place.engine_group is None:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    place.engine_group.broadcast(t, 0).wait()
    return int(t.item())


def _topups_asked(place: Placement, known: int) -> int:
    """Rollout rank: how many dynamic-sampling top-ups the trainer has asked for so far in this
    launch (`known` of them counted before). A top-up is drawn as part of the step it tops up:
    with the weights that step's batch may be drawn with."""
    while place.store.check([f"topup/{known}"]):
        known += 1
    return known


def _await_topup_or_message(place: Placement, due: tuple, topups: int) -> None:
    """Rollout rank with dynamic sampling, behind the weights its next draw needs: polls the
    store until the trainer asks for top-up `topups` or announces its next message (`due`:
    `_message_due`'s arguments; a blocking receive would not see a top-up asked first)."""
    while not (place.store.check([f"topup/{topups}"]) or _message_due(place, *due)):
        time.sleep(0.005)


def _message_due(place: Placement, sync: Sync, evals: int, ckpts: int) -> bool:
    """Rollout rank: the trainer has announced the next sync (or the stop), evaluation
    `evals` or checkpoint `ckpts`: its broadcast over the cross group is on its way."""
    return (place.announced(sync.index + 1) or place.eval_asked(evals)
            or place.checkpoint_asked(ckpts))


def _until_started(place: Placement, collector: RolloutCollector, held_out: list, watchdog
                   ) -> tuple[Sync, int]:
    """Rollout rank, before its first batch: the cross group's messages until the one that
    starts sampling (the first sync, or after a cold start the trainer's release), loading
    every sync and serving every evaluation on the way. Returns (the newest sync, with the
    start and the batch count; the evaluations served)."""
    sync, evals = None, 0
    while True:
        got = receive_weights(place, collector.engine)
        if got.eval is not None:
            evals = _evaluate(place, collector, got.eval, held_out, watchdog)
            continue
        if got.checkpoint is not None:  # nothing drawn yet: the sampler's streams only
            send_state(place.samples, 0, {"next": 0, "loader": None, "parts": [],
                                          "rng": collector.engine.rng_state()})
            continue
        if got.release:  # the cold start's syncs are in: sample from the newest on
            got = dataclasses.replace(sync, start=got.start, batches=got.batches)
        sync = got
        if sync.start is not None or sync.stop:
            return sync, evals


# ---------------------------------------------------------------------- in-flight state
def save_in_flight(place: Placement, collector: RolloutCollector, channel: TensorChannel,
                   ask: dict, starts: dict[int, tuple], i: int, topups: int = 0,
                   out: bool = False) -> int:
    """Rollout rank, between two draws, when the trainer checkpoints (`ask`: its index, the
    batches the trainer took, the launch's batch count and sync index -> policy version):
    sends training rank 0 its in-flight state (`send_state`): the finished parts of batches
    the trainer has not taken and will (their versions made policy versions, their batch
    indices counted from the checkpoint's first untrained batch), and the sampler's streams
    and loader position before the first batch not kept (batches drawn past the launch's
    end are drawn again on resume, as the uninterrupted run draws them). Every batch drawn
    with weights older than the checkpoint's is finished by now (a sync waits for the draw
    it interrupts), so a resumed launch draws the rest with the same weights and streams as
    the uninterrupted one. A rank whose engine failed (`out`) sends only that it is out (the
    checkpoint then keeps no in-flight state). Returns the next checkpoint's index."""
    if out:
        send_state(place.samples, 0, {"next": 0, "loader": None, "rng": {}, "parts": [],
                                      "out": True})
        return ask["index"] + 1
    taken, batches = ask["taken"], ask["batches"]
    # dynamic sampling: the `topups` asked so far are draws of the launch's steps too
    end = i if batches is None else min(i, batches + topups)
    versions = {int(s): v for s, v in ask["versions"].items()}
    rng, loader = starts[end] if end < i else (collector.engine.rng_state(),
                                              collector.loader.state_dict())
    parts = [pack(_restamped(p, taken, versions)) for p in channel.unsent(taken, end)]
    send_state(place.samples, 0, {"next": end - taken, "loader": loader, "rng": rng,
                                  "parts": parts})
    return ask["index"] + 1


def _restamped(part: Part, taken: int, versions: dict[int, int]) -> Part:
    """`part` as a checkpoint keeps it: batch counted from the first untrained one, each
    completion's (and token's) sync index replaced by the policy version it carried."""
    comps = part.completions
    if not part.policy_versions:
        comps = comps.with_versions(versions)
    return dataclasses.replace(part, batch=part.batch - taken, completions=comps,
                               policy_versions=True)


def restore_in_flight(collector: RolloutCollector, channel: TensorChannel, state: dict) -> int:
    """Rollout rank, at the first sync of a resumed launch: its in-flight state from the
    checkpoint (`save_in_flight`) put back: the loader position and the sampler's streams
    of its next draw, the finished parts queued again (sent when the trainer asks). Returns
    the next batch to draw."""
    if state["loader"] is not None:
        collector.loader.load_state_dict(state["loader"])
    collector.engine.set_rng_state(state["rng"])
    for buf in state["parts"]:
        channel.put(unpack(buf))
    return state["next"]


def send_state(pg, dst: int, state: dict) -> None:
    """An in-flight state ({"next", "loader": JSON-able, "rng": name -> tensor, "parts": uint8
    packed parts}) to rank `dst` of `pg` (the samples group, `TAG_STATE`): a JSON header and
    one flat buffer."""
    blobs = [*state["rng"].values(), *state["parts"]]
    head = {"next": state["next"], "loader": state["loader"], "out": state.get("out", False),
            "rng": [[k, str(t.dtype).removeprefix("torch."), list(t.shape)]
                    for k, t in state["rng"].items()],
            "parts": [t.numel() for t in state["parts"]]}
    data = json.dumps(head).encode()
    flat = torch.cat([torch.frombuffer(bytearray(data), dtype=torch.uint8),
                      *(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                        for t in blobs)])
    pg.send([torch.tensor([len(data), flat.numel()], dtype=torch.int64)], dst, TAG_STATE).wait()
    pg.send([flat], dst, TAG_STATE).wait()


def receive_state(pg, src: int) -> dict:
    """The in-flight state rank `src` of `pg` sent (`send_state`)."""
    n = torch.empty(2, dtype=torch.int64)
    pg.recv([n], src, TAG_STATE).wait()
    flat = torch.empty(int(n[1]), dtype=torch.uint8)
    pg.recv([flat], src, TAG_STATE).wait()
    off = int(n[0])
    head = json.loads(flat[:off].numpy().tobytes().decode())
    rng = {}
    for name, dtype, shape in head["rng"]:
        dt = getattr(torch, dtype)
        size = math.prod(shape) * torch.empty(0, dtype=dt).element_size()
        rng[name] = flat[off:off + size].clone().view(dt).reshape(shape)
        off += size
    parts = []
    for size in head["parts"]:
        parts.append(flat[off:off + size].clone())
        off += size
    return {"next": head["next"], "loader": head["loader"], "rng": rng, "parts": parts,
            "out": head.get("out", False)}


def _evaluate(place: Placement, collector: RolloutCollector, ask: dict, held_out: list,
              watchdog, out: bool = False) -> int:
    """Rollout rank: its share of held-out evaluation `ask` (examples j, j + R, ...), greedy
    with the weights its engine holds; (correct, counted) into the store (a rank whose engine
    failed, `out`: (0, 0), its share not evaluated). Returns the next evaluation's index."""
    e = ask["index"]
    if out:
        place.store.set(f"eval/{e}/{place.rollout_index}", json.dumps([0, 0]))
        return e + 1
    if ask["n"] != len(held_out) or ask["digest"] != eval_digest(held_out):
        raise RuntimeError(f"separate placement: the trainer evaluates {ask['n']} held-out "
                           f"examples (digest {ask['digest']}), this rollout rank holds "
                           f"{len(held_out)} (digest {eval_digest(held_out)}): both sides must "
                           "read the same data.eval_path / arithmetic.num_eval")
    watchdog.set_phase("eval", e)
    mine = list(range(place.engine_index, len(held_out), place.engines))
    streams = collector.engine.rng_state()  # left as found: a resumed launch evaluates where
    correct = collector.count_correct(held_out, mine) if mine else 0  # the run did not
    collector.engine.set_rng_state(streams)
    counted = len(mine) if place.engine_rank == 0 else 0  # the leader reports its engine's
    place.store.set(f"eval/{e}/{place.rollout_index}", json.dumps([correct, counted]))
    return e + 1


def _generate_inflight(place: Placement, collector: RolloutCollector, args: tuple, sync: Sync
                       ) -> tuple[tuple, Sync]:
    """One batch with in-flight updates: the engine generates on a thread while this one
    receives every sync the trainer sends meanwhile (the cross group's broadcasts stay on this
    thread) and posts it; the generating thread loads the newest between decode steps, its KV
    cache kept. A sync posted after the last decode step is loaded here before returning, so the
    engine holds the newest weights between batches. Returns the draw and the newest sync (a
    stop message ends the run after this batch)."""
    engine, out, failed = collector.engine, [], []

    def draw() -> None:
        try:
            out.append(collector._generate(*args))
        except BaseException as e:  # re-raised on this thread
            failed.append(e)

    thread = threading.Thread(target=draw, name="megagrpo-inflight-draw", daemon=True)
    thread.start()
    while thread.is_alive():
        if not sync.stop and place.announced(sync.index + 1):
            sync = receive_posted(place, engine)
        else:
            thread.join(timeout=0.005)
    if failed:
        raise failed[0]
    engine.inflight.apply_pending(engine)  # arrived after the last decode step
    return out[0], sync


def _generate_partial(place: Placement, collector: RolloutCollector, args: tuple, sync: Sync
                      ) -> tuple[tuple, Sync]:
    """One batch with partial rollouts (rollout.partial_rollouts): its trajectories generated
    on a thread (one request each, `megagrpo.engine.partial.run_partial`) while this one
    watches for the trainer's next sync; once it is announced the draw pauses between two
    decode steps (trajectories at the cap, rollout.partial_max_updates, are generated to their
    end first), this thread loads the sync, and the paused trajectories continue with the new
    weights, their prefixes recomputed; every token is stamped with the sync that sampled it.
    The batch is scored once whole. Returns the draw and the newest sync (a stop message: the
    rest is generated with the weights held, and the run ends after this batch)."""
    from megagrpo.engine.partial import start_trajectories
    from megagrpo.reward import samples_of
    from megagrpo.rollout.collect import record_scores

    prompts, answers, mine, sampling, records, texts = args
    cap = collector.cfg.rollout.partial_max_updates or collector.cfg.staleness
    trajs, done, recomputed = start_trajectories(mine, sampling.n), [], 0
    while trajs:
        pause = None if sync.stop else threading.Event()
        res = _watching(place, sync, pause, functools.partial(
            collector.engine.generate_partial, prompts, trajs, sampling, version=sync.index,
            pause=pause, max_updates=cap))
        done, trajs = done + res.finished, res.paused
        recomputed += res.recomputed
        if trajs:  # paused: the announced sync is the next message (nothing else is sent
            sync = receive_weights(place, collector.engine)  # before it while a batch waits)
    comps = sorted(done, key=lambda c: (c.prompt_index, c.sample_index))
    samples = samples_of(comps, [c.prompt_index for c in comps], prompts=prompts, texts=texts,
                         answers=answers, records=records, decode=collector._decode)
    rewards, metrics = record_scores(comps, collector.rewards.submit(samples))
    metrics["partial_recomputed_tokens"] = float(recomputed)
    metrics["partial_continued"] = float(sum(len(set(c.token_versions or ())) > 1
                                             for c in comps))
    return (comps, rewards, metrics), sync


def _watching(place: Placement, sync: Sync, pause: threading.Event | None, draw):
    """`draw()` on a thread of its own; `pause` set once the trainer announces the sync after
    `sync`. Returns what `draw` returned (re-raises what it raised)."""
    out, failed = [], []

    def run() -> None:
        try:
            out.append(draw())
        except BaseException as e:  # re-raised on this thread
            failed.append(e)

    thread = threading.Thread(target=run, name="megagrpo-partial-draw", daemon=True)
    thread.start()
    while thread.is_alive():
        if pause is not None and not pause.is_set() and place.announced(sync.index + 1):
            pause.set()
        thread.join(timeout=0.005)
    if failed:
        raise failed[0]
    return out[0]


def _encode(tokenizer, prompt) -> list[int]:
    from megagrpo.data import encode_prompt

    return encode_prompt(tokenizer, prompt)


# ---------------------------------------------------------------------- the trainer's source
@dataclass(frozen=True)
class SeparateLayout:
    """What the trainer reads of a rollout layout under separate placement: the feed is full
    tensors (the rollout ranks' TP is 1)."""

    shard_to_shard: bool = False


@dataclass(kw_only=True)
class SeparateSource:
    """The separate-placement `megagrpo.rollout.stream.RolloutSource`: the trainer's side of the
    stream the rollout ranks feed (module docstring)."""

    cfg: TrainConfig
    place: Placement
    engine: RemoteEngine
    loader: PromptLoader
    """This replica's prompts, walked batch by batch in step with the rollout ranks: its
    position is the next untrained batch (checkpointed as in colocated runs)."""
    tokenizer: object
    ranks: Ranks
    groups: Groups
    layout: SeparateLayout = field(default_factory=SeparateLayout)
    stats: StreamStats = field(default_factory=StreamStats)
    taken: int = 0
    """Batches taken in this launch (the next one's index in the store)."""
    versions: dict[int, int] = field(default_factory=dict)
    """Sync index -> the policy version it carried."""
    queue: list = field(default_factory=list)
    """Always empty: batches sampled ahead stay with the rollout ranks (a checkpoint holds them
    as the rollout ranks' in-flight state, `InFlightState`)."""
    channel: TensorChannel | None = None
    """This rank's end of the sample channel (built from `place` when not given)."""
    topups: int = 0
    """Dynamic-sampling top-ups asked for in this launch (the next one's index in the store)."""
    said_out: set = field(default_factory=set)
    said_no_restart: bool = False

    def __post_init__(self) -> None:
        if self.channel is None:
            self.channel = self.place.channel(self.cfg.data.batch_size,
                                              (self.ranks.dp_rank, self.ranks.dp))

    def next(self, version: int) -> Rollout:
        """This step's rollout: the next batch from the rollout ranks; with dynamic sampling
        (algo.dynamic_sampling) its groups with reward spread, topped up by the next batches
        the rollout ranks draw, as the colocated collector does. `version` is what the last
        sync carried (Trainer.engine_version)."""
        ro = self._take(version)
        if not self.cfg.algo.dynamic_sampling:
            return ro
        return dynamic_sampling(ro, functools.partial(self._top_up, version), self.cfg.algo,
                                self.groups.world)

    def _top_up(self, version: int) -> Rollout:
        """A dynamic-sampling top-up: training rank 0 asks the rollout ranks for it in the store
        (they draw it with the weights of the step it tops up), then every training rank takes
        it as the stream's next batch."""
        if self.ranks.rank == 0:
            self.place.store.set(f"topup/{self.topups}", "1")
        self.topups += 1
        return self._take(version)

    def _take(self, version: int) -> Rollout:
        """Batch `taken` from the rollout ranks (waits for it), this replica's slice."""
        from megagrpo.rollout.stream import Rollout

        i = self.taken
        self._map_syncs(version)
        before = self.loader.state_dict()
        examples = next(self.loader)
        parts = self.channel.take(i)
        bad = [p.loader for p in parts if _position(p.loader) != _position(before)]
        if bad:
            raise RuntimeError(f"separate placement: rollout ranks sampled batch {bad[0]} where "
                               f"the trainer expected {before}")
        n, R = len(examples), self.place.rollout_ranks
        lo = self.ranks.dp_rank * n
        comps, rewards = merged(parts, lo, lo + n, self.versions)
        metrics = {}
        for p in parts:  # counts over the whole batch: per replica on average
            for key, v in p.metrics.items():
                metrics[key] = metrics.get(key, 0.0) + v / self.ranks.dp
        if self.place.failover:
            self._say_outs(i)
            metrics["rollout_ranks_out"] = float(len(self.channel.outs))
            metrics["rollout_makeups"] = float(sum(p.by is not None for p in parts))
        self.stats = StreamStats(queue_depth=self._waiting(i + 1),
                                 draw_s=max(p.draw_s for p in parts) if R else 0.0)
        if self.ranks.rank == 0 and i >= 2:
            self.channel.forget(i - 2)
        self.taken += 1
        return Rollout(prompts=[_encode(self.tokenizer, e.prompt) for e in examples],
                       answers=[e.answer for e in examples], completions=comps,
                       rewards=torch.tensor(rewards),
                       version=int(comps.column("version").min()) if len(comps) else version,
                       epoch=self.loader.epoch, metrics=metrics)

    def _say_outs(self, i: int) -> None:
        """Training rank 0: a console line for each rollout rank newly seen out."""
        for j, gone in sorted(self.channel.outs.items()):
            if j in self.said_out or self.ranks.rank != 0:
                continue
            self.said_out.add(j)
            live = self.place.rollout_ranks - len(self.channel.outs)
            log.warning("rollout rank %d is out: its engine (pid %d) %s at batch %d; its "
                        "prompts go to the %d other rollout rank(s) until the next checkpoint "
                        "(rollout.engine_failure=continue)", self.place.train_world + j,
                        gone["pid"], gone["how"], gone["batch"], live)

    @property
    def degraded(self) -> bool:
        """Training rank 0: a rollout rank is out (its view; `ends_attempt` agrees it)."""
        return any(self.channel.out(j) is not None for j in range(self.place.rollout_ranks))

    def ends_attempt(self, attempt) -> bool:
        """Every training rank, after a checkpoint: whether this torchrun attempt ends here
        (rollout.engine_failure=continue, a rollout rank out and a restart left, so that the job
        goes on with every rollout rank). Rank 0's view decides, broadcast over the training
        ranks."""
        if not self.place.failover:
            return False
        flag = torch.tensor([int(self.ranks.rank == 0 and self.degraded)], dtype=torch.int64)
        dist.broadcast(flag, 0, group=self.groups.world)
        if not flag.item():
            return False
        if attempt.number < attempt.max_restarts:
            return True
        if self.ranks.rank == 0 and not self.said_no_restart:
            log.warning("rollout.engine_failure=continue: no torchrun restart left (--max-"
                        "restarts=%d): the run goes on with %d of %d rollout ranks to its end",
                        attempt.max_restarts, self.place.rollout_ranks - len(self.channel.outs),
                        self.place.rollout_ranks)
        self.said_no_restart = True
        return False

    def _map_syncs(self, version: int) -> None:
        """The syncs sent since the last step carried `version` (what the last one carried)."""
        for s in range(len(self.versions), self.engine.syncs):
            self.versions[s] = version

    def in_flight(self, version: int) -> list[dict]:
        """Training rank 0, at a checkpoint (`version`: what the last sync carried): every
        rollout rank's in-flight state (`save_in_flight`), in rollout-rank order."""
        self._map_syncs(version)
        if self.degraded:  # a rollout rank is out: none is asked (`InFlightState`)
            return []
        self.engine.request_checkpoint(self.taken, self.versions)
        states = [receive_state(self.place.samples, self.place.train_world + j)
                  for j in range(self.place.rollout_ranks)]
        return [] if any(s["out"] for s in states) else states

    def _waiting(self, first: int) -> int:
        """Finished batches from `first` on (every rollout rank's part in)."""
        n = 0
        while self.channel.finished(first + n):
            n += 1
        return n

    def join(self) -> None:
        """Nothing runs on the trainer's side between steps."""

    def ahead_loader_states(self) -> list[dict]:
        return []  # the loader itself stands at the next untrained batch

    def return_batches(self, loader_states: list[dict]) -> None:
        raise ValueError("this checkpoint holds batches a colocated async run drew ahead; "
                         "rollout.placement=separate cannot take them over: resume it with "
                         "rollout.placement=colocated")

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def evaluate(self, examples) -> float:
        """Greedy held-out accuracy of `examples` on the rollout ranks' engines, with the
        weights of the last sync (every training rank waits for it and gets the same)."""
        e = self.engine.request_eval(examples)
        keys = [f"eval/{e}/{j}" for j in range(self.place.rollout_ranks)]
        self.place.store.wait(keys, timedelta(seconds=self.place.timeout_s))
        got = [json.loads(self.place.store.get(k)) for k in keys]
        counted = sum(n for _, n in got)
        if counted < len(examples) and self.ranks.rank == 0:
            log.warning("held-out evaluation %d: %d of %d examples evaluated (the shares of "
                        "rollout ranks that are out are not)", e, counted, len(examples))
        return sum(c for c, _ in got) / max(counted, 1)


class Versioned(Protocol):
    engine_version: int
    """The policy version the last sync carried (`Trainer.engine_version`)."""


@dataclass
class InFlightState:
    """The rollout ranks' side of a separate-placement checkpoint, a per-rank part held by
    training rank 0 (the other training ranks hold nothing): each rollout rank's finished
    parts the trainer has not taken, and the sampler's streams and loader position of its next
    draw (`save_in_flight`), asked for as the checkpoint is written, so it is in the same
    manifest as the weights. Restored (sent with the first sync, `restore_in_flight`) where
    the rollout ranks and rollout.max_staleness are the same; otherwise the console says so and
    the batches drawn ahead are drawn again from the same prompts."""

    source: SeparateSource
    trainer: Versioned

    def state_dict(self) -> dict:
        if self.source.place.cross is None:
            return {}
        states = self.source.in_flight(self.trainer.engine_version)
        return {"rollout_ranks": states, "max_staleness": self.source.cfg.staleness,
                "degraded": not states}

    def load_state_dict(self, state: dict) -> None:
        if self.source.place.cross is None or not state:
            return
        saved, k = state["rollout_ranks"], self.source.cfg.staleness
        if state.get("degraded"):
            log.warning("resume: the checkpoint was written while a rollout rank was out "
                        "(rollout.engine_failure=continue): it holds no in-flight state, so the "
                        "batches the rollout ranks drew ahead are drawn again from the same "
                        "prompts (not bitwise)")
            return
        if len(saved) != self.source.place.rollout_ranks or state["max_staleness"] != k:
            log.warning("resume: the rollout ranks' in-flight state is not restored (saved with "
                        "%d rollout ranks at rollout.max_staleness=%d, now %d at %d): the "
                        "batches they drew ahead are drawn again from the same prompts and the "
                        "run does not continue bitwise", len(saved), state["max_staleness"],
                        self.source.place.rollout_ranks, k)
            return
        self.source.engine.restore = saved


def _position(state: dict) -> tuple[int, int]:
    """A loader position comparable across DP layouts: (epoch, batch index)."""
    return state["epoch"], state["index"]


__all__ = ["InFlightState", "Placement", "RemoteEngine", "SeparateSource", "serve",
           "split_world", "training_world"]
