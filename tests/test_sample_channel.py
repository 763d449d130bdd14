"""The separate-placement sample channel (`megagrpo.rollout.sample_channel`): what the training
ranks receive as packed tensors over gloo is exactly what the rollout ranks produced, field by
field, and exactly what the JSON path through the store delivered (routes, which the JSON path never
carried, against the produced ones).

Real processes: 2 training ranks (DP 2) and 2 rollout ranks spawned over gloo, a file store
shared by all; each rollout rank puts batches 0-3 in both channels, the trainer asks for 0-2
only (batch 3, drawn ahead of the end, is dropped at stop). The parts are single-turn samples,
multi-turn trajectories (loss masks, turn rewards, tool counts, environment retries, dropped
samples), in-flight per-token versions,
MoE routes, non-ASCII text, ragged and empty completions, and log-probs that are not float32
values. The training ranks also merge their slices as the trainer does (`merged`: ordered by
prompt and sample, prompts counted from the replica's first, sync indices made policy
versions), checked against the same done on the produced `Completion` lists in plain Python;
and the trainer's batch builder on columns equals `pack` on the lists (in process).
"""
from __future__ import annotations

import dataclasses
import random
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megagrpo.config.train import TrainConfig
from megagrpo.engine import Completion
from megagrpo.engine.columns import SampleColumns
from megagrpo.parallel.batch import pack as pack_rows
from megagrpo.rollout.sample_channel import (
    Part,
    StoreChannel,
    TensorChannel,
    merged,
    pack,
    replica_range,
    unpack,
)
from megagrpo.rollout.stream import Rollout, sample_versions
from megagrpo.train.advantage import build_batch
from tests.support.launch import save_rank, spawn_ranks

T, R, B, G, ASKED, DRAWN = 2, 2, 8, 3, 3, 4
TEXTS = ["", "42", "x = 7 \u2713 \u00e9t\u00e9", "{\"a\": 1}\n"]


def produced(i: int, j: int) -> Part:
    """Rollout rank j's part of batch i: prompts j, j + R, ... with G samples each, of every
    kind the channel carries (seeded by (i, j), so any process can rebuild it)."""
    rnd = random.Random(1000 * i + j)
    comps, rewards = [], []
    for p in range(j, B, R):
        for s in range(G):
            n = rnd.randint(0, 9)
            kind = (p + s) % 4
            c = Completion(prompt_index=p, sample_index=s,
                           token_ids=[rnd.randrange(151_000) for _ in range(n)],
                           logprobs=[-rnd.random() * 5 for _ in range(n)],  # float64 values
                           finish_reason=rnd.choice(["stop", "length"]),
                           text=rnd.choice(TEXTS),
                           correct=rnd.choice([None, True, False]), version=rnd.randint(0, 5))
            if (p + s) % 5 == 0:  # an empty completion (e.g. EOS first), of any kind
                c.token_ids, c.logprobs = [], []
                n = 0
            if kind == 1:  # a multi-turn trajectory
                c.loss_mask = [rnd.random() < 0.7 for _ in range(n)]
                c.logprobs = [lp if m else 0.0 for lp, m in zip(c.logprobs, c.loss_mask)]
                c.turns, c.tool_calls, c.tool_errors = 3, 2, 1
                c.tool_seconds, c.env_reward = rnd.random(), rnd.random() - 0.5
                c.turn_rewards = [rnd.random() for _ in range(c.turns)]
                c.truncation = "max_turns"
                c.env_retries = rnd.randint(0, 2)
                # a failed environment's or reward's sample leaves the loss: that must travel
                c.dropped = rnd.choice(["", "env_error", "reward_error"])
            elif kind == 2:  # in flight: per-token versions, log-probs as vLLM's (float32)
                c.token_versions = sorted(rnd.randint(0, 3) for _ in range(n))
                c.logprobs = [float(torch.tensor(lp, dtype=torch.float32)) for lp in c.logprobs]
            elif kind == 3:  # MoE routing capture: [prompt + completion, L_moe, k]
                g = torch.Generator().manual_seed(7 * p + s)
                c.routes = torch.randint(-1, 8, (4 + n, 2, 2), dtype=torch.int16, generator=g)
            comps.append(c)
            rewards.append(rnd.random())
    return Part(batch=i, rollout=j, loader={"epoch": 0, "index": i}, epoch=0, draw_s=0.5 + j,
                metrics={"reward/x": float(i + j)}, completions=comps, rewards=rewards)


VERSIONS = {v: 10 + 3 * v for v in range(6)}
"""Sync index -> policy version, as the trainer maps them (`merged`)."""


def merged_reference(parts: list[Part], lo: int, hi: int) -> tuple[list[Completion], list]:
    """What `merged` must give, on the produced `Completion` lists in plain Python."""
    pairs = sorted(((c, r) for p in parts for c, r in zip(_listed(p), p.rewards)
                    if lo <= c.prompt_index < hi),
                   key=lambda x: (x[0].prompt_index, x[0].sample_index))
    out = [dataclasses.replace(c, prompt_index=c.prompt_index - lo, version=VERSIONS[c.version],
                               token_versions=None if c.token_versions is None
                               else [VERSIONS[v] for v in c.token_versions]) for c, _ in pairs]
    return out, [r for _, r in pairs]


def _listed(part: Part) -> list[Completion]:
    return list(part.completions)


def _diff(got: Completion, want: Completion, *, routes: bool = True) -> list[str]:
    """The fields where `got` differs from `want` (value and type: a float must stay a float)."""
    out = []
    for f in dataclasses.fields(Completion):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if f.name == "routes":
            same = (not routes) or (a is None and b is None) or (
                a is not None and b is not None and a.dtype == b.dtype and torch.equal(a, b))
        else:
            same = a == b and type(a) is type(b) and (
                not isinstance(a, list) or [type(x) for x in a] == [type(x) for x in b])
        if not same:
            out.append(f"{f.name}: {a!r} != {b!r}")
    return out


def _part_diff(got: Part, want: Part, *, routes: bool = True) -> list[str]:
    out = [f"{k}" for k in ("batch", "rollout", "loader", "epoch", "draw_s", "metrics",
                            "rewards") if getattr(got, k) != getattr(want, k)]
    if len(got.completions) != len(want.completions):
        return [*out, f"{len(got.completions)} completions, want {len(want.completions)}"]
    for k, (a, b) in enumerate(zip(got.completions, want.completions)):
        out += [f"completion {k}: {d}" for d in _diff(a, b, routes=routes)]
    return out


def _worker(rank: int, world: int, rdzv: str, payload_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    timeout = timedelta(seconds=120)
    store = dist.FileStore(f"{out_dir}/store", world)
    group = dist.ProcessGroupGloo(dist.PrefixStore("samples/", store), rank, world, timeout)
    stream = dist.PrefixStore("stream/", store)
    replica = (rank, T) if rank < T else None
    tensors = TensorChannel(group=group, store=stream, rank=rank, train_world=T,
                            rollout_ranks=R, batch_size=B, timeout_s=120, replica=replica)
    jsons = StoreChannel(store=dist.PrefixStore("json/", store), rollout_ranks=R, timeout_s=120)
    if rank >= T:  # a rollout rank: draws ahead of what the trainer asks
        for i in range(DRAWN):
            tensors.put(produced(i, rank - T))
            jsons.put(produced(i, rank - T))
        store.wait(["stop"], timeout)
        tensors.close()
        save_rank({"sent": tensors.bytes_sent}, out_dir, rank)
        return
    problems, seen = [], []
    lo, hi = replica_range(rank, T, B)
    for i in range(ASKED):
        via_tensors, via_json = tensors.take(i), jsons.take(i)
        for j, (a, b) in enumerate(zip(via_tensors, via_json, strict=True)):
            want = produced(i, j).slice(lo, hi)
            problems += [f"batch {i} rank {j} vs produced: {d}" for d in _part_diff(a, want)]
            problems += [f"batch {i} rank {j} vs JSON: {d}"
                         for d in _part_diff(a, b.slice(lo, hi), routes=False)]
            seen += [(c.prompt_index, c.sample_index) for c in a.completions]
        got, rewards = merged(via_tensors, lo, hi, VERSIONS)
        want, want_rewards = merged_reference([produced(i, j) for j in range(R)], lo, hi)
        problems += [f"batch {i} merged: {d}" for d in _part_diff(
            dataclasses.replace(via_tensors[0], completions=got, rewards=rewards),
            dataclasses.replace(via_tensors[0], completions=want, rewards=want_rewards))]
    if rank == 0:
        store.set("stop", "1")
    save_rank({"problems": problems, "seen": seen, "received": tensors.bytes_received},
              out_dir, rank)


def test_tensor_channel_delivers_what_the_rollout_ranks_produced(tmp_path):
    results = spawn_ranks(_worker, T + R, None, tmp_path)
    for t in range(T):
        assert results[t]["problems"] == [], results[t]["problems"][:5]
        lo, hi = replica_range(t, T, B)  # each replica: all of its prompts' groups, no other
        want = sorted((p, s) for _ in range(ASKED) for p in range(lo, hi) for s in range(G))
        assert sorted(results[t]["seen"]) == want
    # the rollout ranks sent each training rank its slice of the asked batches only
    assert sum(r["sent"] for r in results[T:]) == sum(r["received"] for r in results[:T])


def test_pack_round_trip_and_errors():
    part = produced(0, 1)
    assert _part_diff(unpack(pack(part)), part) == []
    empty = dataclasses.replace(part, completions=[], rewards=[])
    assert _part_diff(unpack(pack(empty)), empty) == []
    with pytest.raises(ValueError, match="2 token ids and 1 log-probs"):
        pack(dataclasses.replace(part, completions=[dataclasses.replace(
            part.completions[0], token_ids=[1, 2], logprobs=[-1.0])], rewards=[0.0]))


def test_part_packed_before_the_columns_unpacks():
    """A part packed by the layout before the columns (as a checkpoint of a separate run keeps
    its queued parts; tests/data holds produced(0, 1) packed by that code) unpacks to what was
    produced."""
    raw = (Path(__file__).parent / "data" / "sample_part_rows_format.bin").read_bytes()
    got = unpack(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    assert _part_diff(got, produced(0, 1)) == []


def test_build_batch_from_columns_equals_pack_from_lists():
    """The trainer's batch from a rollout of columns (as the sample channel delivers it)
    equals `pack` on the same completions as Python lists (the batch builder's path before
    columns), ragged and empty completions, loss masks, truncation and drops included; and the
    rollout's per-sample versions and metrics are the lists' ones."""
    parts = [produced(0, j) for j in range(R)]
    comps, rewards = merged_reference(parts, 0, B)
    for c in comps:
        c.routes = None  # a batch is routed whole or not at all
    prompts = [[1 + p, 2, 3][: 1 + p % 3] for p in range(B)]
    cfg = TrainConfig()
    cfg.algo.group_size, cfg.algo.mask_truncated = G, True
    ro = Rollout(prompts=prompts, answers=[""] * B, completions=SampleColumns.of(comps),
                 rewards=torch.tensor(rewards), version=3)
    batch, shaped = build_batch(ro, cfg, pad_id=0, multiple=4)
    keep = torch.tensor([c.finish_reason != "length" and not c.dropped for c in comps])
    want = pack_rows([prompts[c.prompt_index] for c in comps], [c.token_ids for c in comps],
                     [c.logprobs for c in comps], torch.zeros(len(comps)), pad_id=0,
                     multiple=4, completion_mask=keep, seq_rewards=torch.tensor(rewards),
                     loss_masks=[c.loss_mask for c in comps])
    for name in ("ids", "target", "mask", "rollout_logp", "seq_valid", "lengths", "rewards"):
        assert torch.equal(getattr(batch, name), getattr(want, name)), name
    assert torch.equal(sample_versions(ro), torch.tensor([c.version for c in comps]))
    model = [len(c.token_ids) if c.loss_mask is None else sum(c.loss_mask) for c in comps]
    assert shaped.metrics["completion_len"] == pytest.approx(sum(model) / len(model))
    assert shaped.metrics["dropped_frac"] == sum(bool(c.dropped) for c in comps) / len(comps)
    assert shaped.metrics["truncated_frac"] == pytest.approx(
        sum(c.finish_reason == "length" for c in comps) / len(comps))
    # routed: every row's routes, padding -2
    routed = [dataclasses.replace(c, routes=torch.full(
        (len(prompts[c.prompt_index]) + len(c.token_ids), 2, 2), k, dtype=torch.int16))
              for k, c in enumerate(comps)]
    ro.completions = SampleColumns.of(routed)
    batch, _ = build_batch(ro, cfg, pad_id=0, multiple=4)
    want = pack_rows([prompts[c.prompt_index] for c in comps], [c.token_ids for c in comps],
                     [c.logprobs for c in comps], torch.zeros(len(comps)), pad_id=0,
                     multiple=4, routes=[c.routes for c in routed])
    assert torch.equal(batch.routes, want.routes)


def test_columns_gather_and_versions():
    """Rows gathered across parts (runs and single rows, vocabularies that differ) and versions
    mapped equal the same done on the lists; an unknown version is refused."""
    a, b = list(produced(1, 0).completions), list(produced(2, 1).completions)
    picks = [(1, 3), (0, 0), (0, 1), (0, 2), (1, 0), (1, 4), (0, 5)]
    got = SampleColumns.gather([SampleColumns.of(a), SampleColumns.of(b)], picks)
    want = [(a, b)[s][r] for s, r in picks]
    assert [d for g, w in zip(got, want) for d in _diff(g, w)] == []
    mapped = list(SampleColumns.of(a).with_versions(VERSIONS))
    assert [c.version for c in mapped] == [VERSIONS[c.version] for c in a]
    assert [c.token_versions for c in mapped] == [
        None if c.token_versions is None else [VERSIONS[v] for v in c.token_versions] for c in a]
    with pytest.raises(KeyError, match="no mapping"):
        SampleColumns.of(a).with_versions({0: 0})
    assert len(SampleColumns.gather([SampleColumns.of(a)], [])) == 0
