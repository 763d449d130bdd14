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

The code: this module holds the world split and the wire (`Placement`, `split_world`,
`RemoteEngine`, `receive_weights`); `megagrpo.rollout.serve` a rollout rank's loop (`serve`,
and `MakeUps` for rollout.engine_failure=continue); `megagrpo.rollout.in_flight` the rollout
ranks' in-flight state (`save_in_flight`, `restore_in_flight`, `send_state`); and
`megagrpo.rollout.separate_source` the trainer's side (`SeparateSource`, `InFlightState`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch
import torch.distributed as dist

from megagrpo.config.lora import LoRAConfig
from megagrpo.config.model import ModelConfig, ParallelConfig
from megagrpo.config.placement import training_world
from megagrpo.engine.shard_feed import received_tensors as received_shards
from megagrpo.lora.export import save_peft_adapter
from megagrpo.rollout.in_flight import receive_state, send_state
from megagrpo.rollout.sample_channel import TensorChannel
from megagrpo.runtime.distributed import process_group_backend

if TYPE_CHECKING:
    from megagrpo.config.train import TrainConfig
    from megagrpo.data import PromptLoader

log = logging.getLogger("megagrpo")

WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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



__all__ = ["Placement", "RemoteEngine", "Sync", "receive_weights", "split_world",
           "training_world"]
