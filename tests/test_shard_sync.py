"""Shard-to-shard weight sync to rollout ranks of their own (`sync.transport=shards`,
`megagrpo.sync.transports.shards` and `megagrpo.engine.shard_feed`): what a rollout rank's
engine is fed equals the HF checkpoint of the trainer's weights, bitwise, tensor for tensor.

Real processes: the 4 training ranks of a TP=2 x PP=2 layout and 1 rollout rank, spawned over
gloo with a file store. Each training rank holds its megatron shards of a random HF checkpoint
(read with the loader's `read_shard`, the path a run's `run.init` takes; vocab 19 padded to 32,
GQA, untied embeddings) and sends them through the transport in small buckets (several per
stage); the rollout rank receives through `placement.receive_weights`, as `serve` does, into
an engine that keeps what it is fed. Two syncs (the second of other weights), then the stop.
"""
from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from megagrpo.config.model import ModelConfig, ParallelConfig
from megagrpo.data import Example, PromptLoader
from megagrpo.engine import WeightSyncStats
from megagrpo.hf import hf_shapes, param_specs, save_hf_dir
from megagrpo.hf.io import HFCheckpoint, read_shard
from megagrpo.rollout.placement import Placement, RemoteEngine, receive_weights
from megagrpo.sync.transports.shards import Shards
from tests.support.launch import save_rank, spawn_ranks

TP, PP, SYNCS = 2, 2, 2
MODEL = ModelConfig(vocab_size=19, hidden_size=64, ffn_hidden_size=128, num_layers=2,
                    num_attention_heads=4, num_query_groups=2, head_dim=32,
                    max_position_embeddings=64, tie_word_embeddings=False)
PARALLEL = ParallelConfig(tp=TP, pp=PP, make_vocab_size_divisible_by=16)


class KeepingEngine:
    """Keeps every tensor it is fed, as fed."""

    def __init__(self) -> None:
        self.received: list[dict[str, torch.Tensor]] = []

    def update_weights(self, pairs):
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
        syncs = [receive_weights(place, engine) for _ in range(SYNCS + 1)]
        assert [s.stop for s in syncs] == [False] * SYNCS + [True]
        torch.save(engine.received, f"{out_dir}/received.pt")
        save_rank({"syncs": [s.index for s in syncs]}, out_dir, rank)
        return
    stage, tp_rank = divmod(rank, TP)  # this test's layout: TP fastest
    place.store.set(f"shards/{stage}/{tp_rank}", str(rank))
    loader = PromptLoader([Example(prompt="1", answer="1")] * 4, 2)
    remote = RemoteEngine(place=place, loader=loader, sends=True, bucket_bytes=6000,
                          dtype="float32", batches=3)
    sent = []
    for sync in range(SYNCS):
        ckpt = HFCheckpoint(f"{out_dir}/hf{sync}")
        expected = hf_shapes(MODEL)
        specs = param_specs(MODEL, PARALLEL, stage)
        pairs = [(s.local, read_shard(ckpt, s, MODEL, tp_rank, TP, expected)) for s in specs]
        stats = Shards(remote, stage).send(iter(pairs))
        sent.append({"bytes": stats.bytes, "tensors": stats.tensors})
    if rank == 0:
        remote.close()
    save_rank({"sent": sent}, out_dir, rank)


def test_rollout_rank_gets_the_hf_weights_bitwise_from_tp2_pp2_shards(tmp_path):
    for sync in range(SYNCS):
        _checkpoint(tmp_path / f"hf{sync}", seed=sync)
    results = spawn_ranks(_worker, TP * PP + 1, None, tmp_path)
    received = torch.load(tmp_path / "received.pt")
    assert len(received) == SYNCS and results[-1]["syncs"] == [0, 1, SYNCS]
    for sync, got in enumerate(received):
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
