"""The weight sync (`megagrpo.sync`) against fake engines, in this process (no ranks): the
transport `sync.transport=auto` picks is today's (placement, in-flight updates, LoRA serving),
the refusals before compute, what the engine's feed is declared to get (`config.params` plus the
transforms) against what the source and transforms really emit, the in-flight transport's
post -> join -> deliver order, a fourth transport registered from this module and selected by
config alone (trainer.py and run.py untouched), and the QKV interleave against an index
reference. The real engines: tests/test_rollout_layout.py, test_inflight.py, test_placement.py,
test_lora_run.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megagrpo.config.lora import LoRAConfig
from megagrpo.config.model import ModelConfig, ParallelConfig
from megagrpo.config.params import hf_shapes
from megagrpo.config.train import TrainConfig, load_config
from megagrpo.engine.feed import _WeightFeed
from megagrpo.engine.inflight import InflightUpdates
from megagrpo.engine.types import WeightSyncStats
from megagrpo.hf import fuse_qkv, param_specs, split_qkv, unfuse_shards
from megagrpo.preflight import check_transport
from megagrpo.rollout.placement import Placement, RemoteEngine
from megagrpo.sync import CastDtype, FullWeights, WeightSync, build_weight_sync
from megagrpo.sync.adapters import AdapterSource, MergeAdapters
from megagrpo.sync.source import Feed, OwnShards
from megagrpo.sync.transforms import expected_feed
from megagrpo.sync.transports import (
    SyncContext,
    Transport,
    available,
    register,
    transport_class,
)
from megagrpo.sync.transports.collective import Collective
from megagrpo.sync.transports.inflight import Inflight
from megagrpo.sync.transports.reload import Reload
from megagrpo.sync.transports.shards import Shards
from megagrpo.train.trainer import Trainer

MODEL = ModelConfig(vocab_size=19, hidden_size=16, ffn_hidden_size=24, num_layers=2,
                    num_attention_heads=4, num_query_groups=2, head_dim=4, qkv_bias=True)


class FakeEngine:
    """Records every update (names, shapes, dtypes of what it pulled, and how)."""

    class _Core:
        label = None

        def set_weight_version(self, v: str) -> None:
            self.label = v

    def __init__(self, *, inflight: bool = False, max_lora_rank: int = 0):
        self.inflight = InflightUpdates() if inflight else None
        self.max_lora_rank = max_lora_rank
        self.llm = type("LLM", (), {"llm_engine": self._Core()})()
        self.loads: list[dict] = []

    def update_weights(self, pairs, *, reset_prefix_cache: bool = True,
                       dtypes=None) -> WeightSyncStats:
        """Pulls the pairs through the real engine's checked feed (names, shapes and, when the
        sync declared them, dtypes), with no fused groups to hold back."""
        shapes = {n: torch.Size(s) for n, s in hf_shapes(MODEL).items()}
        feed = _WeightFeed(pairs, shapes, set(), {}, dtypes)
        got = {n: (tuple(t.shape), t.dtype) for n, t in feed}
        if feed.error is not None:
            raise feed.error
        self.loads.append({"tensors": got, "reset_prefix_cache": reset_prefix_cache,
                           "dtypes": dtypes})
        return WeightSyncStats(tensors=len(got), bytes=0, seconds=0.0, source_seconds=0.0,
                               load_seconds=0.0)


class Stage(torch.nn.Module):
    """A policy stage holding the layout's parameters (TP = PP = 1) under their local names."""

    def __init__(self, model: ModelConfig):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.params = {s.local: torch.randn(s.full_shape, generator=g)
                       for s in param_specs(model, ParallelConfig(), 0)}

    def named_parameters(self, *args, **kwargs):
        return iter(self.params.items())


@pytest.fixture
def one_rank(monkeypatch):
    """megatron's parallel state of a single rank (TP = PP = 1: the stream runs no
    collective)."""
    from megatron.core import parallel_state as ps

    for name, value in (("get_pipeline_model_parallel_rank", 0),
                        ("get_tensor_model_parallel_rank", 0),
                        ("get_tensor_model_parallel_group", None),
                        ("get_pipeline_model_parallel_group", None)):
        monkeypatch.setattr(ps, name, lambda v=value: v)


def _build(overrides: list[str], engine, lora_rank: int = 0, shard_to_shard: bool = False,
           tmp: Path = Path("unused")) -> WeightSync:
    cfg = load_config(None, overrides)
    lora = LoRAConfig(rank=lora_rank) if lora_rank else cfg.lora
    return build_weight_sync(cfg.sync, cfg.rollout, lora, model=MODEL, parallel=cfg.parallel,
                             engine=engine, shard_to_shard=shard_to_shard, folder=tmp)


# ---------------------------------------------------------------------- the choice
def test_auto_picks_todays_transport_and_source(one_rank):
    place = Placement(rank=0, train_world=1, rollout_ranks=1, store=None, cross=None,
                      timeout_s=1.0, weights="a group")  # built, never used: nothing is sent
    remote = RemoteEngine(place=place, loader=None, sends=False, bucket_bytes=1,
                          dtype="float32")
    reload = _build([], FakeEngine())
    assert type(reload.transport) is Reload and type(reload.source) is FullWeights
    assert reload.transforms == ()
    inflight = _build(["rollout.inflight_updates=true", "rollout.max_staleness=1"],
                      FakeEngine(inflight=True))
    assert type(inflight.transport) is Inflight
    separate = _build(["rollout.placement=separate", "rollout.rollout_ranks=1"], remote)
    assert type(separate.transport) is Shards and type(separate.source) is OwnShards
    with_ep = _build(["rollout.placement=separate", "rollout.rollout_ranks=1", "parallel.ep=2"],
                     remote)  # experts are not sent shard to shard yet
    assert type(with_ep.transport) is Collective and type(with_ep.source) is FullWeights
    with pytest.raises(ValueError, match=r"sync\.transport=shards with parallel\.ep=2"):
        _build(["rollout.placement=separate", "rollout.rollout_ranks=1", "parallel.ep=2",
                "sync.transport=shards"], remote)
    slices = _build([], FakeEngine(), shard_to_shard=True)
    assert type(slices.source).__name__ == "ShardSlices"
    served = _build([], FakeEngine(max_lora_rank=8), lora_rank=4)  # vLLM serves the adapters
    assert isinstance(served.source, AdapterSource) and served.transforms == ()
    assert set(served.checkpoint_parts()) == {"adapter_refit"}
    merged = _build([], FakeEngine(), lora_rank=4)  # it does not: merged weights
    assert [type(t) for t in merged.transforms] == [MergeAdapters]
    assert merged.checkpoint_parts() == {}
    cast = _build(["sync.dtype=bfloat16"], FakeEngine())
    assert cast.transforms == (CastDtype(torch.bfloat16),)
    assert _build(["sync.dtype=float32"], FakeEngine()).transforms == ()  # the model's own


@pytest.mark.parametrize("transport", [Collective, Shards])
def test_transports_to_rollout_ranks_refuse_a_colocated_engine(transport, tmp_path):
    """Built by hand past the config's checks with a colocated engine, a transport that sends to
    rollout ranks refuses before anything moves, naming itself and the fix."""
    name = transport.__name__.lower()
    with pytest.raises(ValueError, match=rf"sync\.transport={name} sends to rollout ranks: it "
                                         r"needs rollout\.placement=separate; set sync\.transport"
                                         r"=auto"):
        transport.build(SyncContext(engine=FakeEngine(), model=ModelConfig(), folder=tmp_path,
                                    parallel=ParallelConfig()))


@pytest.mark.parametrize("overrides, match", [
    (["sync.transport=collective"], r"sync\.transport=collective with rollout\.placement="
                                    r"colocated.*set sync\.transport=auto"),
    (["sync.transport=reload", "rollout.placement=separate", "rollout.rollout_ranks=1"],
     r"sync\.transport=reload with rollout\.placement=separate"),
    (["sync.transport=inflight"], r"sync\.transport=inflight with rollout\.inflight_updates="
                                  r"false.*rollout\.inflight_updates=true"),
    (["sync.transport=reload", "rollout.inflight_updates=true", "rollout.max_staleness=1"],
     r"sync\.transport=reload with rollout\.inflight_updates=true"),
    (["sync.dtype=int8"], r"sync\.dtype='int8'"),
    (["sync.transport=no-such"], r"sync\.transport='no-such'"),
    # rollout.sync_delta: the shards transport of separate placement only, not in flight
    (["rollout.sync_delta=true"], r"rollout\.sync_delta=true .*this run's sync is reload \(its "
                                  r"engines are colocated\); set rollout\.sync_delta=false"),
    (["rollout.sync_delta=true", "rollout.placement=separate", "rollout.rollout_ranks=1",
      "sync.transport=collective"], r"sync is collective \(sync\.transport=collective\)"),
    (["rollout.sync_delta=true", "rollout.placement=separate", "rollout.rollout_ranks=1",
      "rollout.inflight_updates=true", "rollout.max_staleness=1"],
     r"rollout\.sync_delta=true with rollout\.inflight_updates=true: .*set "
     r"rollout\.sync_delta=false or rollout\.inflight_updates=false"),
])
def test_refused_before_compute_naming_the_field(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, overrides).validate()


def test_unknown_transport_names_the_choices():
    assert {"reload", "inflight", "collective", "disk"} <= set(available())
    with pytest.raises(ValueError, match=r"sync\.transport='nowhere' names no transport"):
        check_transport("nowhere")
    check_transport("disk")
    with pytest.raises(ValueError, match=r"sync\.transport='nowhere'.*'reload'"):
        transport_class("nowhere")


# ---------------------------------------------------------------------- what the feed gets
@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_declared_feed_is_what_source_and_transforms_emit(one_rank, tmp_path, dtype):
    engine = FakeEngine()
    ws = _build([f"sync.dtype={dtype}"], engine, tmp=tmp_path)
    policy = Stage(MODEL)
    out = ws.sync(policy, 3)
    declared = {n: (m.shape, m.dtype) for n, m in ws.expects(MODEL).items()}
    assert engine.loads[-1]["tensors"] == declared
    want = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    assert {d for _, d in declared.values()} == {want}
    # embed, norm, lm_head; per layer: 2 norms, q/k/v weights and biases, o, gate, up, down
    assert len(declared) == 3 + MODEL.num_layers * 12
    assert ws.version == 3 and out["sync_bytes"] > 0
    assert set(out) == {"sync_bytes", "sync_received_bytes", "sync_gather_s", "sync_load_s"}


def test_the_engine_checks_what_the_transforms_declared(one_rank, tmp_path):
    """The declaration reaches the engine with every feed, and its checked feed holds the
    pairs to it: a transform whose `pairs` forget the cast its `emits` declares is refused by
    name, before vLLM would load weights of another precision than the run thinks it syncs."""
    engine = FakeEngine()
    ws = _build(["sync.dtype=bfloat16"], engine, tmp=tmp_path)
    ws.sync(Stage(MODEL), 1)
    assert engine.loads[-1]["dtypes"] == {n: m.dtype for n, m in ws.expects(MODEL).items()}

    class Forgets(CastDtype):
        def pairs(self, pairs):
            return pairs  # declares bfloat16 (CastDtype.emits), sends float32

    liar = WeightSync(ws.source, Reload(engine), [Forgets(torch.bfloat16)],
                      declared=expected_feed(MODEL, [Forgets(torch.bfloat16)]))
    with pytest.raises(ValueError, match=r"arrived as torch.float32; the sync declared "
                                         r"torch.bfloat16"):
        liar.sync(Stage(MODEL), 2)


def test_disk_writes_an_hf_folder_the_engine_loads(one_rank, tmp_path):
    engine = FakeEngine()
    ws = _build(["sync.transport=disk"], engine, tmp=tmp_path)
    out = ws.sync(Stage(MODEL), 1)
    declared = {n: (m.shape, m.dtype) for n, m in ws.expects(MODEL).items()}
    assert engine.loads[-1]["tensors"] == declared
    assert (tmp_path / "synced" / "model.safetensors.index.json").exists()
    assert (tmp_path / "synced" / "config.json").exists() and out["sync_bytes"] > 0


def test_the_stream_refuses_parameters_outside_the_layout(one_rank):
    """A LoRA policy streamed without its merged view would carry W alone."""
    policy = Stage(MODEL)
    policy.params["decoder.layers.0.mlp.linear_fc2.lora_A"] = torch.zeros(2, 24)
    with pytest.raises(ValueError, match=r"outside the layout.*lora_A.*parameters_for_refit"):
        _build([], FakeEngine()).sync(policy, 1)


# ---------------------------------------------------------------------- in flight
def test_inflight_posts_after_the_update_and_loads_after_the_join(one_rank):
    engine = FakeEngine(inflight=True)
    ws = _build(["rollout.inflight_updates=true", "rollout.max_staleness=1"], engine)
    slot, policy = engine.inflight, Stage(MODEL)
    ws.post(policy, 1)  # gathered on the main thread, not loaded yet
    assert slot.pending_version == 1 and engine.loads == []
    out = ws.sync(policy, 1)  # no draw took it: loaded after the join, once
    assert len(engine.loads) == 1 and engine.loads[0]["reset_prefix_cache"]
    assert slot.pending_version is None and engine.llm.llm_engine.label == "1"
    assert out["inflight_midway"] == 0.0 and out["sync_bytes"] > 0
    ws.post(policy, 2)
    slot.apply_pending(engine, midway=True)  # the running draw took it between decode steps
    out = ws.sync(policy, 2)
    assert len(engine.loads) == 2 and not engine.loads[1]["reset_prefix_cache"]
    assert out["inflight_midway"] == 1.0 and engine.llm.llm_engine.label == "2"
    ws.post(policy, 2)  # no update applied: nothing posted, the sync reloads and labels
    assert slot.pending_version is None
    out = ws.sync(policy, 2)
    assert len(engine.loads) == 3 and out["inflight_midway"] == 0.0


# ---------------------------------------------------------------------- a fourth transport
@register("record")
class Record(Transport):
    """A toy transport: keeps what it was given."""

    def __init__(self) -> None:
        self.got: list[tuple[int, list[str]]] = []

    @classmethod
    def build(cls, ctx) -> Record:
        return cls()

    def deliver(self, feed: Feed, version: int) -> dict:
        self.got.append((version, [n for n, _ in feed.pairs]))
        return dict(feed.gather_metrics(), sync_load_s=0.0)


def test_a_registered_transport_is_selected_by_config_alone(one_rank):
    cfg = load_config(None, ["sync.transport=record"])
    cfg.validate()
    assert "record" in available()
    ws = build_weight_sync(cfg.sync, cfg.rollout, cfg.lora, model=MODEL, parallel=cfg.parallel,
                           engine=FakeEngine(), shard_to_shard=False, folder=Path("unused"))
    tr = Trainer(TrainConfig(), model_cfg=MODEL, policy=Stage(MODEL), weight_sync=ws)
    tr.version = 5
    out = tr.sync_weights()
    assert type(ws.transport) is Record and tr.engine_version == 5
    (version, names), = ws.transport.got
    assert version == 5 and set(names) == set(ws.expects(MODEL))
    assert out["sync_bytes"] > 0


# ---------------------------------------------------------------------- the QKV interleave
def _qkv_reference_rows(nh: int, ng: int, hd: int) -> tuple[list[int], list[int], list[int]]:
    """Fused row of every HF q, k, v row, counted by hand: group g's block holds its nh/ng q
    heads, then its k head, then its v head, hd rows each."""
    per = nh // ng
    block = (per + 2) * hd
    q = [(h // per) * block + (h % per) * hd + d for h in range(nh) for d in range(hd)]
    k = [g * block + per * hd + d for g in range(ng) for d in range(hd)]
    v = [g * block + (per + 1) * hd + d for g in range(ng) for d in range(hd)]
    return q, k, v


@pytest.mark.parametrize("nh, ng", [(4, 2), (6, 3), (4, 4), (8, 1)])
def test_qkv_interleave_against_an_index_reference(nh, ng):
    hd, H = 3, 5
    model = ModelConfig(num_attention_heads=nh, num_query_groups=ng, head_dim=hd, hidden_size=H)
    rows = ng * (nh // ng + 2) * hd
    fused = torch.arange(rows * H, dtype=torch.float64).view(rows, H)
    want = [fused[idx] for idx in _qkv_reference_rows(nh, ng, hd)]
    got = [p.reshape(-1, H) for p in split_qkv(fused, model)]
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    assert torch.equal(fuse_qkv(*want, model), fused)
    bias = torch.arange(rows, dtype=torch.float64)  # a 1-D QKV bias interleaves alike
    assert torch.equal(fuse_qkv(*[p.reshape(-1) for p in split_qkv(bias, model)], model), bias)
    spec = next(s for s in param_specs(model, ParallelConfig(), 0)
                if s.kind == "qkv" and s.local.endswith("weight"))
    if ng % 2 == 0:  # two TP shards of whole groups give the same HF tensors
        halves = list(fused.chunk(2))
        for (_, t), w in zip(unfuse_shards(halves, spec, model), want):
            assert torch.equal(t, w)
