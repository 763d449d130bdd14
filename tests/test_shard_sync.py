"""Shard-to-shard weight sync to rollout ranks of their own (`sync.transport=shards`,
`megagrpo.sync.transports.shards` and `megagrpo.engine.shard_feed`): what a rollout rank's
engine is fed equals the HF checkpoint of the trainer's weights, bitwise, tensor for tensor.

Real processes: the 4 training ranks of a TP=2 x PP=2 layout and 1 rollout rank, spawned over
gloo with a file store. Each training rank holds its megatron shards of a random HF checkpoint
(read with the loader's `read_shard`, the path a run's `run.init` takes; vocab 19 padded to 32,
GQA, untied embeddings) and sends them through the transport in small buckets (several per
stage); the rollout rank receives through `placement.receive_weights`, as `serve` does, into
an engine that keeps what it is fed. Two syncs (the second of other weights), then three
delta syncs (rollout.sync_delta: `SentDigests`; the first sends all, the next two only what
changed, one change on a single TP rank's half of a tensor), a full sync of the last weights,
then the stop: the engine's weights after the deltas equal that full sync's, bitwise, and the
frozen embedding crossed only once.
"""
from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megagrpo.config.model import ModelConfig, ParallelConfig
from megagrpo.data import Example, PromptLoader
from megagrpo.engine import WeightSyncStats
from megagrpo.engine.shard_feed import SentDigests
from megagrpo.hf import hf_shapes, param_specs, save_hf_dir
from megagrpo.hf.io import HFCheckpoint, read_shard
from megagrpo.rollout.placement import Placement, RemoteEngine, receive_weights
from megagrpo.sync.transports.shards import Shards
from tests.support.launch import save_rank, spawn_ranks

TP, PP, SYNCS = 2, 2, 2
DELTAS = 3
"""Delta syncs after the SYNCS full ones (checkpoints hf2.. hf4), then one full sync of hf4."""
CHANGES = [
    {},  # hf2 = hf1: the first delta sync sends everything (nothing sent by it yet)
    {"model.layers.0.self_attn.k_proj.weight": None, "model.layers.1.mlp.down_proj.weight": None,
     "model.norm.weight": None},
    {"lm_head.weight": slice(16, 19),  # vocab rows of TP rank 1's half only
     "model.layers.1.mlp.up_proj.weight": None},
]
"""What each delta checkpoint changes against the one before (None: the whole tensor)."""
RESENT = [
    None,
    {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
     "model.layers.0.self_attn.v_proj.weight", "model.layers.1.mlp.down_proj.weight",
     "model.norm.weight"},
    {"lm_head.weight", "model.layers.1.mlp.gate_proj.weight",
     "model.layers.1.mlp.up_proj.weight"},
]
"""By hand: the HF tensors a delta sync must carry (a changed part of a fused megatron
parameter brings its siblings: q/k/v, gate/up)."""
MODEL = ModelConfig(vocab_size=19, hidden_size=64, ffn_hidden_size=128, num_layers=2,
                    num_attention_heads=4, num_query_groups=2, head_dim=32,
                    max_position_embeddings=64, tie_word_embeddings=False)
PARALLEL = ParallelConfig(tp=TP, pp=PP, make_vocab_size_divisible_by=16)


class KeepingEngine:
    """Keeps every tensor it is fed, as fed, and whether the update was partial (a delta)."""

    def __init__(self) -> None:
        self.received: list[dict[str, torch.Tensor]] = []
        self.partial: list[bool] = []

    def update_weights(self, pairs, partial: bool = False):
        self.partial.append(partial)
        got = {}
        for name, t in pairs:
            assert name not in got, f"{name} fed twice in one sync"
            got[name] = t.clone()
        self.received.append(got)
        return WeightSyncStats(tensors=len(got), bytes=0, seconds=0.0, source_seconds=0.0,
                               load_seconds=0.0)


def _checkpoint(folder: Path, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    save_hf_dir(folder, MODEL, ((n, torch.randn(s, generator=g))
                                for n, s in hf_shapes(MODEL).items()))


def _delta_checkpoints(tmp_path: Path) -> None:
    """hf2..hf4: hf1 changed step by step as CHANGES says."""
    from safetensors.torch import load_file

    state = {}
    for f in sorted((tmp_path / "hf1").glob("*.safetensors")):
        state.update(load_file(f))
    g = torch.Generator().manual_seed(7)
    for i, changes in enumerate(CHANGES):
        for name, rows in changes.items():
            t = state[name].clone()
            t[rows if rows is not None else slice(None)] += torch.randn(
                t[rows if rows is not None else slice(None)].shape, generator=g)
            state[name] = t
        save_hf_dir(tmp_path / f"hf{SYNCS + i}", MODEL, iter(state.items()))


def _worker(rank: int, world: int, rdzv: str, payload_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    T, timeout = TP * PP, timedelta(seconds=120)
    store = dist.FileStore(f"{out_dir}/store", world)
    cross = None
    if rank in (0, T):  # training rank 0 and the rollout rank
        cross = dist.ProcessGroupGloo(dist.PrefixStore("cross/", store), 0 if rank == 0 else 1,
                                      2, timeout)
    weights = dist.ProcessGroupGloo(dist.PrefixStore("weights/", store), rank, world, timeout)
    place = Placement(rank=rank, train_world=T, rollout_ranks=1,
                      store=dist.PrefixStore("stream/", store), cross=cross, timeout_s=120,
                      weights=weights, model=MODEL, parallel=PARALLEL)
    if rank == T:
        engine = KeepingEngine()
        syncs = [receive_weights(place, engine) for _ in range(SYNCS + DELTAS + 2)]
        assert [s.stop for s in syncs] == [False] * (SYNCS + DELTAS + 1) + [True]
        torch.save(engine.received, f"{out_dir}/received.pt")
        assert engine.partial == [False] * SYNCS + [True] * DELTAS + [False]
        save_rank({"syncs": [s.index for s in syncs]}, out_dir, rank)
        return
    stage, tp_rank = divmod(rank, TP)  # this test's layout: TP fastest
    place.store.set(f"shards/{stage}/{tp_rank}", str(rank))
    loader = PromptLoader([Example(prompt="1", answer="1")] * 4, 2)
    remote = RemoteEngine(place=place, loader=loader, sends=True, bucket_bytes=6000,
                          dtype="float32", batches=3)
    tp_group = dist.ProcessGroupGloo(dist.PrefixStore(f"tp{stage}/", store), tp_rank, TP,
                                     timeout)
    delta = Shards(remote, stage, SentDigests(), tp_group)
    sent = []
    for sync in range(SYNCS + DELTAS + 1):
        ckpt = HFCheckpoint(f"{out_dir}/hf{min(sync, SYNCS + DELTAS - 1)}")
        expected = hf_shapes(MODEL)
        specs = param_specs(MODEL, PARALLEL, stage)
        pairs = [(s.local, read_shard(ckpt, s, MODEL, tp_rank, TP, expected)) for s in specs]
        transport = delta if SYNCS <= sync < SYNCS + DELTAS else Shards(remote, stage)
        stats = transport.send(iter(pairs))
        sent.append({"bytes": stats.bytes, "tensors": stats.tensors,
                     "embedding": sum(t.numel() * t.element_size() for n, t in pairs
                                      if "word_embeddings" in n)})
    if rank == 0:
        remote.close()
    save_rank({"sent": sent}, out_dir, rank)


@pytest.fixture(scope="module")
def shard_syncs(tmp_path_factory):
    """One launch: the syncs of the module docstring, what the rollout rank received and what
    each training rank sent."""
    tmp_path = tmp_path_factory.mktemp("shard_sync")
    for sync in range(SYNCS):
        _checkpoint(tmp_path / f"hf{sync}", seed=sync)
    _delta_checkpoints(tmp_path)
    results = spawn_ranks(_worker, TP * PP + 1, None, tmp_path)
    return tmp_path, results, torch.load(tmp_path / "received.pt")


def test_rollout_rank_gets_the_hf_weights_bitwise_from_tp2_pp2_shards(shard_syncs):
    tmp_path, results, received = shard_syncs
    assert results[-1]["syncs"] == list(range(SYNCS + DELTAS + 2))
    for sync, got in enumerate(received[:SYNCS]):
        ckpt = HFCheckpoint(tmp_path / f"hf{sync}")
        assert sorted(got) == sorted(hf_shapes(MODEL))  # every tensor once, no other
        for name, t in got.items():
            want = ckpt.rows(name, 0, hf_shapes(MODEL)[name][0], name)
            assert t.dtype == want.dtype and torch.equal(t, want), name
    # no training rank sent the whole model: each sent its own shards, in several buckets
    total = sum(t.numel() * 4 for t in received[0].values())
    for r in results[:-1]:
        assert 0 < r["sent"][0]["bytes"] < total
    index = json.loads((tmp_path / "hf0" / "model.safetensors.index.json").read_text())
    assert len(index["weight_map"]) == len(received[0])


def test_delta_syncs_equal_a_full_sync_bitwise(shard_syncs):
    """rollout.sync_delta: the engine's weights after the delta syncs (each a partial update
    over the last) equal a full sync of the same weights and the checkpoint, bitwise; each
    delta after the first carries exactly the tensors that changed (and their fused
    siblings), a change on one TP rank's half included (both halves sent: the TP ranks
    agreed); the frozen embedding crossed once, counted in the bytes every rank sent."""
    tmp_path, results, received = shard_syncs
    deltas, full = received[SYNCS:SYNCS + DELTAS], received[-1]
    engine = dict(received[SYNCS - 1])  # the engine's weights before the deltas: hf1
    for got in deltas:
        engine.update(got)
    assert sorted(full) == sorted(hf_shapes(MODEL)) == sorted(engine)
    ckpt = HFCheckpoint(tmp_path / f"hf{SYNCS + DELTAS - 1}")
    for name, t in full.items():
        assert torch.equal(engine[name], t), name
        assert torch.equal(t, ckpt.rows(name, 0, hf_shapes(MODEL)[name][0], name)), name
    assert sorted(deltas[0]) == sorted(hf_shapes(MODEL))  # nothing sent by the delta sender yet
    for got, want in zip(deltas[1:], RESENT[1:]):
        assert set(got) == want
    for r in results[:-1]:  # training ranks: bytes sent by each sync
        full_bytes, emb = r["sent"][SYNCS]["bytes"], r["sent"][SYNCS]["embedding"]
        assert r["sent"][SYNCS]["bytes"] == r["sent"][-1]["bytes"] > 0
        for later in r["sent"][SYNCS + 1:SYNCS + DELTAS]:
            assert later["bytes"] <= full_bytes - emb
    stage0 = results[:TP]  # the embedding's stage: only layer 0's q/k/v changed after hf2
    assert all(r["sent"][SYNCS]["embedding"] > 0 for r in stage0)
    assert [r["sent"][SYNCS + 2]["bytes"] for r in stage0] == [0, 0]
