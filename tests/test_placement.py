"""Separate placement (rollout.placement=separate, issue 30 item 1): training ranks and rollout
ranks in one torchrun world, weights over a gloo group, finished groups through the store.

In-process checks (a second each): the wire and the stream run for real (two gloo process
groups over one store, the rollout rank's `serve` loop on a thread with a fake engine that
samples a marker of the weights it holds), so what is checked is the protocol itself: every
weight arrives bitwise in bounded buckets; every completion's version is the sync that sampled
it (the marker says so) and lags the trainer by at most k; each replica gets its contiguous
slice and every prompt is trained once, in the loader's own order, across a resume. The
refusals name their field. One real-process run (3 ranks: 2 training ranks DP=2 + 1 rollout
rank, megatron-core and vLLM, through the CLI) checks that it trains, that vLLM's log-probs on
samples of the trainer's own version equal the trainer's to fp32 precision, and that the
per-sample staleness never exceeds k. Two more launches compose it: a tiny Qwen3-MoE with
routing replay, merged LoRA, held-out evaluation and a cold start, and the dense model with
adapter-only LoRA syncs and rollout.sync_delta (bytes counted on both sides). A pair of runs
of the calculator tool task with LoRA served by vLLM and dynamic sampling (colocated on 1
rank; 1 training rank + 2 rollout ranks forming one engine of TP 2, and with `-m heavy` 1 + 1)
checks that multi-turn trajectories and top-ups at separate placement are the colocated run's
for the same seeds.
"""
from __future__ import annotations

import dataclasses
import json
import re
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megagrpo.checkpoint import load_tree, save_tree
from megagrpo.config.layout import RolloutLayout
from megagrpo.config.placement import training_world
from megagrpo.config.train import TrainConfig, load_config
from megagrpo.data import Example, PromptLoader, encode_prompt
from megagrpo.engine import Completion, SamplingSettings, WeightSyncStats
from megagrpo.engine.types import NO_VERSION
from megagrpo.reward import Rewards
from megagrpo.rollout.collect import RolloutCollector
from megagrpo.rollout.placement import Placement, RemoteEngine, receive_weights
from megagrpo.rollout.sample_channel import unpack
from megagrpo.rollout.separate_source import InFlightState, SeparateSource
from megagrpo.rollout.serve import serve
from megagrpo.runtime.distributed import Groups, Ranks
from megagrpo.sync.transports.collective import Collective
from tests.support.cli import run_cli, train_logged
from tests.support.launch import run_loopback_nodes
from tests.test_stream import Reward, Tok

G, B = 2, 4


class MarkerEngine:
    """Samples two tokens per completion whose first log-prob is the weight 'marker' it holds
    (so a completion says which weights sampled it); keeps every tensor it was fed."""

    def __init__(self) -> None:
        self.marker, self.received = -1.0, []
        self.gen = torch.Generator().manual_seed(7)  # the sampler's stream

    def rng_state(self) -> dict[str, torch.Tensor]:
        return {"cpu": self.gen.get_state()}

    def set_rng_state(self, state) -> None:
        self.gen.set_state(state["cpu"])

    def generate(self, prompts, sampling):
        return [Completion(prompt_index=i, sample_index=j, token_ids=[p[-1], 3 + j],
                           logprobs=[self.marker, -0.25], finish_reason="stop", text=f"{p[-1]}")
                for i, p in enumerate(prompts) for j in range(sampling.n)]

    def update_weights(self, pairs):
        got = {n: t.clone() for n, t in pairs}
        self.received.append(got)
        self.marker = float(got["marker"][0])
        return WeightSyncStats(tensors=len(got), bytes=0, seconds=0.0, source_seconds=0.0,
                               load_seconds=0.0)


class Watchdog:
    def set_phase(self, name, step=None):
        pass


def _config(k: int) -> TrainConfig:
    cfg = TrainConfig()
    cfg.algo.group_size, cfg.algo.beta, cfg.data.batch_size = G, 0.0, B
    cfg.rollout.max_staleness, cfg.rollout.placement, cfg.rollout.rollout_ranks = k, "separate", 2
    return cfg


def _weights(version: int) -> list[tuple[str, torch.Tensor]]:
    """A policy of 'version': a marker and tensors of both sizes around the bucket bound."""
    g = torch.Generator().manual_seed(version)
    return [("marker", torch.full((2,), float(version))),
            ("a", torch.randn(40, 30, generator=g)), ("b", torch.randn(7, generator=g)),
            ("c", torch.randn(300, generator=g))]


class InflightMarkerEngine(MarkerEngine):
    """A MarkerEngine with a real in-flight slot (`InflightUpdates`): three decode steps a
    completion, a posted update loaded before any of them (the KV-kept path after the first);
    each token's log-prob is the marker of the weights that sampled it and its version the
    slot's label. From its second draw on, decode step 1 waits (up to 1 s) for a post, so the
    trainer's next sync lands mid-generation."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        from megagrpo.engine.inflight import InflightUpdates

        super().__init__()
        self.inflight, self.draws, self.labels = InflightUpdates(), 0, []
        self.llm = SimpleNamespace(llm_engine=SimpleNamespace(
            set_weight_version=self.labels.append))

    def update_weights(self, pairs, reset_prefix_cache=True):
        return super().update_weights(pairs)

    def generate(self, prompts, sampling):
        tokens = []
        for step in range(3):
            deadline = time.monotonic() + 1.0
            while (step == 1 and self.draws and self.inflight.pending_version is None
                   and time.monotonic() < deadline):
                time.sleep(0.002)
            self.inflight.apply_pending(self, midway=step > 0)
            tokens.append((self.marker, self.inflight.version))
        self.draws += 1
        return [Completion(prompt_index=i, sample_index=j, token_ids=[p[-1], 3 + j, 5],
                           logprobs=[m for m, _ in tokens], finish_reason="stop",
                           text=f"{p[-1]}", token_versions=[v for _, v in tokens])
                for i, p in enumerate(prompts) for j in range(sampling.n)]


class SamplingMarkerEngine(MarkerEngine):
    """A MarkerEngine whose third token is drawn from its sampler's stream: which weights
    sampled a completion is in its first log-prob, where the stream stood in its last token."""

    def generate(self, prompts, sampling):
        out = super().generate(prompts, sampling)
        for c in out:
            c.token_ids.append(int(torch.randint(0, 1000, (1,), generator=self.gen)))
            c.logprobs.append(-0.5)
        return out


class PartialMarkerEngine(MarkerEngine):
    """`generate_partial` as `megagrpo.engine.partial.run_partial` behaves: three decode steps
    a trajectory, each token's log-prob the marker of the weights that sampled it and its
    version the sync given; at a set pause, between two steps, the trajectories below the cap
    are handed back unfinished. Every second batch is slow: its decode steps 1 and 2 wait (up
    to 1 s) for a pause, so syncs land mid-generation; the others end at once, so the rank
    runs ahead and a slow batch can span k syncs."""

    def __init__(self) -> None:
        super().__init__()
        self.batches, self.slow = 0, False

    def generate_partial(self, prompts, trajs, sampling, *, version, pause=None, max_updates=0):
        from megagrpo.engine.partial import PartialResult, first_version

        if all(not t.token_ids for t in trajs):  # a new batch
            self.batches += 1
            self.slow = self.batches % 2 == 0
        recomputed = sum(len(t.token_ids) for t in trajs)
        live, paused = list(trajs), []
        while live:
            step = len(live[0].token_ids)
            deadline = time.monotonic() + 1.0
            while (step >= 1 and self.slow and pause is not None and not pause.is_set()
                   and time.monotonic() < deadline):
                time.sleep(0.002)
            if pause is not None and pause.is_set() and not paused:
                paused = [t for t in live if version - first_version(t, version) < max_updates]
                live = [t for t in live if t not in paused]
            for t in live:
                t.token_ids.append(prompts[t.prompt_index][-1] if step == 0 else 3 + step)
                t.logprobs.append(self.marker)
                t.token_versions.append(version)
            if step == 2:
                for t in live:
                    t.finish_reason, t.text = "stop", str(prompts[t.prompt_index][-1])
                break
        return PartialResult(finished=live, paused=paused, tokens=0, recomputed=recomputed)


class AgentPartialEngine(MarkerEngine):
    """Multi-turn partial rollouts on a rollout rank: tests/test_agent_partial.py's engine
    (each id from the exact prefix, a turn ends on an id divisible by 4; the pause contract of
    `run_partial`), each token's log-prob -0.01 (id + 1) - the marker of the weights it holds.
    Once per sync, its call's third decode step waits (up to 0.5 s) for the pause, so the
    trainer's next sync lands while some trajectories are mid-turn and others have ended
    their turn (held between turns)."""

    def __init__(self) -> None:
        from tests.test_agent_partial import Engine

        super().__init__()
        rule = self  # the rule's log-prob names the weights held, not the version passed

        class Rule(Engine):
            def _one(self, prefix, done, j, version):
                tok, _ = super()._one(prefix, done, j, 0)
                return tok, -0.01 * (tok + 1) - rule.marker

        self.rule, self.waited = Rule({tuple(p) for p in _agent_prompts()}), set()

    def generate_partial(self, prompts, trajs, sampling, *, version, pause=None,
                         max_updates=0, limits=None, oldest=None):
        rule, start = self.rule, self.rule.steps

        class Waiting:  # the pause as the engine reads it: held at the third step, once a sync
            def is_set(_) -> bool:
                if rule.steps - start == 2 and version not in self.waited:
                    self.waited.add(version)
                    deadline = time.monotonic() + 0.5
                    while not pause.is_set() and time.monotonic() < deadline:
                        time.sleep(0.002)
                return pause.is_set()

        return rule.generate_partial(prompts, trajs, sampling, version=version,
                                     pause=None if pause is None else Waiting(),
                                     max_updates=max_updates, limits=limits, oldest=oldest)


class EvalMarkerEngine(MarkerEngine):
    """A MarkerEngine whose greedy completions (held-out evaluation) answer prompt + marker:
    which weights evaluated is in the text."""

    def generate(self, prompts, sampling):
        out = super().generate(prompts, sampling)
        if sampling.temperature == 0:
            for c in out:
                c.text = str(prompts[c.prompt_index][-1] + int(self.marker))
        return out


def _launch(data, k: int, steps: int, start: dict | None, store, engine=MarkerEngine,
            train_s: float = 0.0, batches: int | None = None,
            held_out: list[Example] | None = None, cold_syncs: int = 0, settle: bool = False,
            checkpoint: bool = False, restore: dict | None = None, partial_cap: int = -1,
            failover: bool = False, agent: bool = False) -> dict:
    """One launch of a separate-placement world in this process: 2 rollout ranks (threads) and
    2 training replicas (both read here, replica 0 sends; a step "trains" `train_s` seconds
    before its sync; with `held_out`, both replicas evaluate it after every sync; `cold_syncs`:
    a cold start first, syncs of markers -cold_syncs..-1 each evaluated, released after the
    first step's sync). `settle`: before each sync the rollout ranks finish every batch the
    bound lets them draw, so batch b is drawn with sync b - k (the launch's last with its own),
    whatever the threads' timing. `checkpoint`: after the steps, the next sync and a
    checkpoint of the rollout ranks' in-flight state (`InFlightState`, through save_tree's
    format), returned as "in_flight"; `restore`: such a state, put back at the first sync.
    `partial_cap` >= 0: rollout.partial_rollouts with that rollout.partial_max_updates.
    `failover`: rollout.engine_failure=continue (`engine` is called with the rollout index).
    `agent`: multi-turn rollouts on the rollout ranks (`AGENT_ENV`, 3 turns, rollout.max_tokens
    a turn as tests/test_agent_partial.py's runner has them). Returns what each side saw."""
    cfg = _config(k)
    if failover:
        cfg.rollout.engine_failure = "continue"
    if partial_cap >= 0:
        cfg.rollout.partial_rollouts, cfg.rollout.partial_max_updates = True, partial_cap
    if agent:
        cfg.agent.environment, cfg.agent.max_turns = AGENT_ENV, 3
        cfg.rollout.max_tokens = AGENT_S.max_tokens
    timeout = timedelta(seconds=60)
    groups: dict[int, object] = {}

    def group(r):
        groups[r] = dist.ProcessGroupGloo(dist.PrefixStore("cross/", store), r, 3, timeout)

    def sample_group(r):
        samples[r] = dist.ProcessGroupGloo(dist.PrefixStore("samples/", store), r, 4, timeout)

    samples: dict[int, object] = {}
    threads = [threading.Thread(target=group, args=(r,)) for r in range(3)]
    threads += [threading.Thread(target=sample_group, args=(r,)) for r in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    stream = dist.PrefixStore("stream/", store)
    places = [Placement(rank=r, train_world=2, rollout_ranks=2, store=stream,
                        cross=groups[0] if r == 0 else groups.get(r - 1) if r >= 2 else None,
                        timeout_s=60, samples=samples[r], failover=failover)
              for r in range(4)]
    engines = [engine(j) for j in range(2)] if failover else [engine(), engine()]
    served = {}
    rollout_threads = []
    for j in range(2):
        col = RolloutCollector(cfg=cfg, engine=engines[j], tokenizer=Tok(),
                               rewards=Rewards(Reward()),
                               loader=PromptLoader(data, B, seed=3),
                               layout=RolloutLayout(rank=0, world_size=1, engine_tp=1,
                                                    train_tp=1, train_pp=1))
        rollout_threads.append(threading.Thread(target=lambda j=j, col=col: served.update(
            {j: serve(cfg, places[2 + j], col, Watchdog(), held_out=held_out)}), daemon=True))
        rollout_threads[-1].start()
    loaders = [PromptLoader(data, B, d, 2, seed=3) for d in range(2)]
    if start is not None:
        [ld.load_state_dict(start) for ld in loaders]
    remote = RemoteEngine(place=places[0], loader=loaders[0], sends=True, bucket_bytes=2000,
                          dtype="float32", batches=batches)
    sources = [SeparateSource(cfg=cfg, place=places[d], engine=remote, loader=loaders[d],
                              tokenizer=Tok(), ranks=Ranks(rank=d, dp=2, dp_rank=d),
                              groups=None) for d in range(2)]
    version = start["version"] if start else 0
    in_flight = InFlightState(sources[0], SimpleNamespace(engine_version=version))
    if restore is not None:
        in_flight.load_state_dict(restore)
    steps_seen, accuracies = [], []
    remote.held = cold_syncs > 0
    for marker in range(-cold_syncs, 0):  # a cold start: weights that sample nothing
        Collective(remote).send(iter(_weights(marker)))
        time.sleep(0.05)  # time enough to draw, were a rollout rank to start too early
        if held_out is not None:
            accuracies.append([src.evaluate(held_out) for src in sources])
    for s in range(steps + checkpoint):
        time.sleep(train_s if version else 0.0)
        if settle and s > 0:  # (a restored launch's first ones are in the restored queue)
            _settle(sources[0], s, k, batches)
        Collective(remote).send(iter(_weights(version)))  # the sync before the step
        if s == steps:  # checkpoint "after step s": its sync, then the rollout ranks' state
            in_flight.trainer.engine_version = version
            with tempfile.TemporaryDirectory() as tmp:
                save_tree(Path(tmp) / "rank0.safetensors", in_flight.state_dict())
                in_flight_state = load_tree(Path(tmp) / "rank0.safetensors")
            break
        remote.release()  # after a cold start, with the weights it ended at
        if held_out is not None:
            accuracies.append([src.evaluate(held_out) for src in sources])
        if failover:  # one sender serves both replicas: they receive at once, as processes do
            rollouts = [None, None]
            takers = [threading.Thread(target=lambda d=d: rollouts.__setitem__(
                d, sources[d].next(version))) for d in range(2)]
            [t.start() for t in takers]
            [t.join(timeout=60) for t in takers]
        else:
            rollouts = [src.next(version) for src in sources]
        steps_seen.append((version, rollouts))
        version += 1
    remote.close()
    for t in rollout_threads:
        t.join(timeout=30)
    return {"steps": steps_seen, "engines": engines, "served": served, "accuracy": accuracies,
            "loader": dict(loaders[0].state_dict(), version=version),
            "in_flight": in_flight_state if checkpoint else None}


def _settle(source: SeparateSource, s: int, k: int, batches: int) -> None:
    """Before sync s: waits until the rollout ranks have finished every batch the bound lets
    them draw with sync s - 1 (b <= s - 1 + k, not the launch's last)."""
    deadline = time.monotonic() + 30
    for b in range(s, min(s - 1 + k, batches - 2) + 1):
        while not source.channel.finished(b):
            assert time.monotonic() < deadline, f"batch {b} not drawn"
            time.sleep(0.002)


def _data() -> list[Example]:
    return [Example(prompt=str(100 + i), answer=str(100 + i)) for i in range(12)]


AGENT_ENV = "tests.test_agent_partial:Answers"
AGENT_S = SamplingSettings(max_tokens=6, n=G)


def _agent_data() -> list[Example]:
    """`_data` with the records tests/test_agent_partial.py's environment reads."""
    return [dataclasses.replace(e, record={"k": i % 3}) for i, e in enumerate(_data())]


def _agent_prompts() -> list[list[int]]:
    return [encode_prompt(Tok(), e.prompt) for e in _agent_data()]


@pytest.mark.parametrize("k", [0, 1, 2])
def test_stream_versions_slices_and_weights(k):
    """The launch's last batch (the trainer says which at the first sync) is drawn
    on-policy whatever k is."""
    run = _launch(_data(), k, steps=5, start=None, store=dist.HashStore(), batches=5)
    reference = PromptLoader(_data(), B, seed=3)  # the global batch order the trainer must see
    for version, (ro0, ro1) in run["steps"]:
        want = [int(e.prompt) for e in next(reference)]
        assert [p[-1] for ro in (ro0, ro1) for p in ro.prompts] == want
        for ro in (ro0, ro1):
            assert len(ro.completions) == G * len(ro.prompts) and len(ro.rewards) == G * 2
            for c in ro.completions:  # each group whole, on its own prompt
                assert c.token_ids[0] == ro.prompts[c.prompt_index][-1]
                assert c.logprobs[0] == c.version  # stamped with the weights that sampled it
                assert 0 <= version - c.version <= k
        if k == 0 or version == 4:  # k = 0, or the last of the 5 batches
            assert all(c.version == version for c in ro0.completions + ro1.completions)
    assert sorted(run["served"]) == [0, 1]  # close() stopped both rollout ranks
    for eng in run["engines"]:  # every sync arrived bitwise, through several buckets
        assert len(eng.received) == 5
        for v, got in enumerate(eng.received):
            assert list(got) == [n for n, _ in _weights(v)]
            assert all(torch.equal(got[n], t) for n, t in _weights(v))


@pytest.mark.parametrize("k", [1, 2])
def test_inflight_updates_enter_running_draws(k):
    """rollout.inflight_updates under separate placement: syncs the trainer sends while a
    rollout rank generates are received on its main thread and loaded between decode steps;
    every token's version is the sync that sampled it (its log-prob is that sync's marker),
    mapped to the trainer's versions, and a sample's version is its oldest token's, at most k
    behind the step that trains it."""
    run = _launch(_data(), k, steps=5, start=None, store=dist.HashStore(),
                  engine=InflightMarkerEngine, train_s=0.05)
    mixed = 0
    for version, ros in run["steps"]:
        for c in (c for ro in ros for c in ro.completions):
            assert c.logprobs == [float(v) for v in c.token_versions]
            assert c.token_versions == sorted(c.token_versions)
            assert c.version == c.token_versions[0] and 0 <= version - c.version <= k
            mixed += len(set(c.token_versions)) > 1
    assert mixed >= 3 * 2 * B * G // 2  # the draws of steps 2-4 at least: new weights midway
    for eng in run["engines"]:  # every sync arrived bitwise and labelled the engine
        assert len(eng.received) == 5 and eng.labels == [str(v) for v in range(5)]
        for v, got in enumerate(eng.received):
            assert all(torch.equal(got[n], t) for n, t in _weights(v))


@pytest.mark.parametrize("k", [0, 2])
def test_held_out_evaluation_on_the_rollout_ranks(k):
    """Held-out evaluation at separate placement: each rollout rank evaluates its share of the
    examples, greedy, with the weights of every sync sent before the request, while it samples
    up to k batches ahead; every training replica gets the whole set's accuracy. Against the
    hand count: the engine's greedy answer is prompt + the weights' version, and 1, 2, 3, 4 of
    the 10 examples expect version 0, 1, 2, 3 (none 4), so after sync v the accuracy is
    (v + 1) / 10 (0 at v = 4); weights one sync stale, or a rollout rank's share counted
    twice or not at all, give other figures."""
    want_version = [0, 1, 1, 2, 2, 2, 3, 3, 3, 3]
    held_out = [Example(prompt=str(200 + i), answer=str(200 + i + v))
                for i, v in enumerate(want_version)]
    run = _launch(_data(), k, steps=5, start=None, store=dist.HashStore(),
                  engine=EvalMarkerEngine, held_out=held_out)
    hand = [sum(v == version for v in want_version) / 10 for version in range(5)]
    assert run["accuracy"] == [[a, a] for a in hand] and hand == [0.1, 0.2, 0.3, 0.4, 0.0]
    assert [run["served"][j]["evaluations"] for j in range(2)] == [10, 10]  # both replicas


@pytest.mark.parametrize("k", [0, 2])
def test_cold_start_holds_the_rollout_ranks(k):
    """A cold start at separate placement: its syncs reach the rollout ranks, which evaluate
    with them (accuracy against the hand count: version -3..-1 weights answer no example) but
    draw nothing until the trainer releases them after the cold start's last sync; then
    every sample comes from the weights GRPO starts with or newer, at most k behind, the
    launch's last batch on-policy (a rollout rank that drew with the first sync's weights
    would stamp a negative marker)."""
    held_out = [Example(prompt=str(200 + i), answer=str(200 + i + v))
                for i, v in enumerate([0, 1, 1, 2, 2, 2, 3, 3, 3, 3])]
    run = _launch(_data(), k, steps=5, start=None, store=dist.HashStore(),
                  engine=EvalMarkerEngine, held_out=held_out, cold_syncs=3, batches=5)
    assert run["accuracy"] == [[a, a] for a in (0.0, 0.0, 0.0, 0.1, 0.2, 0.3, 0.4, 0.0)]
    for version, ros in run["steps"]:
        for c in (c for ro in ros for c in ro.completions):
            assert c.logprobs[0] >= 0 and 0 <= version - c.logprobs[0] <= k
        if version == 4:
            assert all(c.logprobs[0] == 4 for ro in ros for c in ro.completions)
    for eng in run["engines"]:  # the cold start's syncs were loaded, in order
        assert [float(got["marker"][0]) for got in eng.received] == [-3, -2, -1, 0, 1, 2, 3, 4]


class SpreadEngine(MarkerEngine):
    """A MarkerEngine whose sample 0 of prompt p answers p and the others answer p only where
    p % 3 == 0: those prompts' groups have no reward spread (dynamic sampling filters them)."""

    def generate(self, prompts, sampling):
        out = super().generate(prompts, sampling)
        for c in out:
            p = prompts[c.prompt_index][-1]
            c.text = str(p) if c.sample_index == 0 or p % 3 == 0 else "no"
        return out


class Lockstep:
    """What vLLM's TP collectives do to an engine's ranks, for fake engines: every draw or
    sync of one rank meets the same operation of the others (a barrier), and an operation met
    by a different one is recorded."""

    def __init__(self, ranks: int) -> None:
        self.barrier = threading.Barrier(ranks, timeout=10)
        self.last: dict[int, tuple] = {}
        self.mismatches: list = []

    def meet(self, rank: int, op: tuple) -> None:
        self.last[rank] = op
        try:
            self.barrier.wait()
            if len(set(map(repr, self.last.values()))) > 1:
                self.mismatches.append(dict(self.last))
            self.barrier.wait()
        except threading.BrokenBarrierError:
            self.mismatches.append(("alone", rank, op))
            self.barrier.reset()


class LockstepSpreadEngine(SpreadEngine):
    """A SpreadEngine of one rank of an engine of TP > 1: each draw (its prompts) and each sync
    (its marker) meets the other ranks' (`Lockstep`), as vLLM's collectives inside them
    would."""

    def __init__(self, lockstep: Lockstep, rank: int) -> None:
        super().__init__()
        self.lockstep, self.rank, self.ops = lockstep, rank, []

    def generate(self, prompts, sampling):
        self.ops.append(("draw", [p[-1] for p in prompts]))
        self.lockstep.meet(self.rank, self.ops[-1])
        return super().generate(prompts, sampling)

    def update_weights(self, pairs):
        out = super().update_weights(pairs)
        self.ops.append(("sync", self.marker))
        self.lockstep.meet(self.rank, self.ops[-1])
        return out


class LaggingStore:
    """A store whose `check` of a top-up key answers False its first `lag` times: one rollout
    rank seeing the trainer's top-up requests later than its engine's other ranks."""

    def __init__(self, store, lag: int = 3) -> None:
        self.store, self.lag, self.seen = store, lag, {}

    def check(self, keys):
        if keys[0].startswith("topup/"):
            self.seen[keys[0]] = self.seen.get(keys[0], 0) + 1
            if self.seen[keys[0]] <= self.lag:
                return False
        return self.store.check(keys)

    def __getattr__(self, name):
        return getattr(self.store, name)


def _dynsamp_launch(k: int, steps: int, batches: int, start: dict | None = None,
                    restore: dict | None = None, checkpoint: bool = False,
                    engine_tp: int = 1) -> dict:
    """One launch of algo.dynamic_sampling at separate placement in this process: 1 training
    rank, 1 rollout rank (a thread) with a SpreadEngine, or `engine_tp` rollout ranks forming
    one engine (LockstepSpreadEngines; the last rank sees top-up requests late, LaggingStore);
    `steps` steps of a launch of `batches` from loader position `start` (with "version");
    `checkpoint`: then the next sync and the rollout rank's in-flight state (returned as
    "in_flight"); `restore`: such a state, put back at the first sync. Returns each step's
    (version, top-up rounds, kept prompts, the markers of the weights that sampled them), what
    the rollout rank did, the loader, the engines."""
    cfg = _config(k)
    R = engine_tp
    cfg.algo.dynamic_sampling, cfg.rollout.rollout_ranks = True, R
    cfg.rollout.tensor_parallel_size = engine_tp
    store, timeout = dist.HashStore(), timedelta(seconds=60)
    groups: dict = {}
    threads = [threading.Thread(target=lambda r=r, pre=pre: groups.update({(pre, r): (
        dist.ProcessGroupGloo(dist.PrefixStore(pre, store), r, 1 + R, timeout))}))
        for r in range(1 + R) for pre in ("cross/", "samples/")]
    if engine_tp > 1:
        threads += [threading.Thread(target=lambda r=r: groups.update({("engine/", r): (
            dist.ProcessGroupGloo(dist.PrefixStore("engine/", store), r, R, timeout))}))
            for r in range(R)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    stream = dist.PrefixStore("stream/", store)
    places = [Placement(rank=r, train_world=1, rollout_ranks=R,
                        store=LaggingStore(stream) if engine_tp > 1 and r == R else stream,
                        cross=groups["cross/", r], timeout_s=60, samples=groups["samples/", r],
                        engine_tp=engine_tp, engine_group=groups.get(("engine/", r - 1)))
              for r in range(1 + R)]
    lockstep = Lockstep(R)
    engines = [LockstepSpreadEngine(lockstep, j) if engine_tp > 1 else SpreadEngine()
               for j in range(R)]
    served, rollouts = {}, []
    for j in range(R):
        col = RolloutCollector(cfg=cfg, engine=engines[j], tokenizer=Tok(),
                               rewards=Rewards(Reward()), loader=PromptLoader(_data(), B, seed=3),
                               layout=RolloutLayout(rank=0, world_size=1, engine_tp=1,
                                                    train_tp=1, train_pp=1))
        rollouts.append(threading.Thread(target=lambda j=j, col=col: served.update(
            {j: serve(cfg, places[1 + j], col, Watchdog())}), daemon=True))
        rollouts[-1].start()
    loader = PromptLoader(_data(), B, seed=3)
    if start is not None:
        loader.load_state_dict(start)
    remote = RemoteEngine(place=places[0], loader=loader, sends=True, bucket_bytes=2000,
                          dtype="float32", batches=batches)
    src = SeparateSource(cfg=cfg, place=places[0], engine=remote, loader=loader,
                         tokenizer=Tok(), ranks=Ranks(), groups=Groups())
    version = start["version"] if start else 0
    in_flight = InFlightState(src, SimpleNamespace(engine_version=version))
    if restore is not None:
        in_flight.load_state_dict(restore)
    seen, state = [], None
    for s in range(steps + checkpoint):
        Collective(remote).send(iter(_weights(version)))
        if s == steps:
            in_flight.trainer.engine_version = version
            with tempfile.TemporaryDirectory() as tmp:
                save_tree(Path(tmp) / "rank0.safetensors", in_flight.state_dict())
                state = load_tree(Path(tmp) / "rank0.safetensors")
            break
        ro = src.next(version)
        assert all(c.version == c.logprobs[0] for c in ro.completions)
        seen.append((version, ro.metrics["resample_rounds"], [p[-1] for p in ro.prompts],
                     sorted({c.logprobs[0] for c in ro.completions})))
        version += 1
    remote.close()
    for t in rollouts:
        t.join(timeout=30)
    return {"seen": seen, "served": served[0], "in_flight": state, "engines": engines,
            "loader": dict(loader.state_dict(), version=version)}


def _kept_by_hand(steps: int, rounds_cap: int) -> list[tuple[int, list[int]]]:
    """Per step (top-up rounds, kept prompts) of SpreadEngine's samples over the loader's own
    batch sequence: groups of prompts p % 3 != 0 kept, topped up until B or the cap."""
    reference, want = PromptLoader(_data(), B, seed=3), []
    for _ in range(steps):
        batch = [int(e.prompt) for e in next(reference)]
        kept, rounds = [p for p in batch if p % 3], 0
        while len(kept) < B and rounds < rounds_cap:
            kept += [p for p in (int(e.prompt) for e in next(reference)) if p % 3]
            rounds += 1
        want.append((rounds, kept[:B] or batch))
    return want


@pytest.mark.parametrize("k", [0, 1, 2])
def test_dynamic_sampling_tops_up_from_the_rollout_ranks(k):
    """algo.dynamic_sampling at separate placement (1 training rank, 1 rollout rank, 6 steps):
    each step trains the groups with reward spread of its batch and of as many top-ups as it
    needs, which the rollout rank draws when asked; against the hand count over the loader's
    own batch sequence (kept prompts and top-up rounds per step). Every sample, top-ups
    included, is at most k syncs behind the step that trains it (k = 0: on-policy), and the
    launch's last step on-policy: a rollout rank that counted a top-up as the next step's
    batch would wait for a sync that never comes (k = 0) or draw a later step's samples
    with older weights."""
    steps = 6
    run = _dynsamp_launch(k, steps, steps)
    want = _kept_by_hand(steps, TrainConfig().algo.max_resample_rounds)
    assert [(r, kept) for _, r, kept, _ in run["seen"]] == want
    assert sum(r for r, _ in want) >= steps
    for version, _, _, markers in run["seen"]:
        assert all(0 <= version - m <= (0 if version == steps - 1 else k) for m in markers)
    assert run["served"]["batches"] >= steps + sum(r for r, _ in want)


@pytest.mark.parametrize("k", [0, 1])
def test_dynamic_sampling_on_an_engine_of_two_ranks(k):
    """algo.dynamic_sampling with the rollout ranks forming one engine of TP 2 whose second
    rank sees each top-up request late (its store check says no three times): both ranks run
    the same draws and syncs in the same order (the leader's top-up count and wait decision,
    taken over the engine's group), and the trainer gets the hand count's batches. A rank that
    counted the top-ups on its own would decide to wait while the leader draws, and the two
    ranks' decisions, broadcast over the engine's group, would pair up out of step."""
    steps = 4
    run = _dynsamp_launch(k, steps, steps, engine_tp=2)
    want = _kept_by_hand(steps, TrainConfig().algo.max_resample_rounds)
    assert [(r, kept) for _, r, kept, _ in run["seen"]] == want
    assert sum(r for r, _ in want) >= 2
    lead, peer = (e.ops for e in run["engines"])
    assert run["engines"][0].lockstep.mismatches == []
    assert lead == peer and len(lead) >= 2 * steps, (lead, peer)


def test_dynamic_sampling_resumes_from_the_in_flight_state():
    """A checkpoint of a dynamic-sampling launch (k = 0) after step 4 keeps the rollout rank's
    draws the trainer has not taken, counting the top-ups among the launch's draws; the
    resumed launch trains steps 5-6 as the uninterrupted one does (kept prompts, top-up
    rounds, the weights that sampled them). Counting steps alone (the trainer took 8 draws
    of a 6-step launch), the checkpoint would keep the rollout rank's state before a draw
    the trainer took already, and the resumed launch's first batch would not be its own."""
    whole = _dynsamp_launch(0, 6, 6)
    first = _dynsamp_launch(0, 4, 6, checkpoint=True)
    second = _dynsamp_launch(0, 2, 2, start=first["loader"], restore=first["in_flight"])
    assert 4 + sum(r for _, r, _, _ in first["seen"]) > 6  # more draws than the launch's steps
    assert first["seen"] + second["seen"] == whole["seen"]


def test_resume_starts_the_rollout_ranks_at_the_first_untrained_batch():
    """3 steps, then a new launch from the trainer's loader state: the prompts continue the
    uninterrupted sequence (batches the rollout ranks drew ahead are drawn again)."""
    first = _launch(_data(), 2, steps=3, start=None, store=dist.HashStore())
    second = _launch(_data(), 2, steps=3, start=first["loader"], store=dist.HashStore())
    trained = [p[-1] for run in (first, second) for _, ros in run["steps"] for ro in ros
               for p in ro.prompts]
    reference = PromptLoader(_data(), B, seed=3)
    assert trained == [int(e.prompt) for _ in range(6) for e in next(reference)]


@pytest.mark.parametrize("k,cap", [(2, 0), (2, 1)])  # k = 1 runs the same path
def test_partial_rollouts_on_the_rollout_ranks(k, cap):
    """rollout.partial_rollouts under separate placement: a rollout rank pauses its draw when
    the trainer announces a sync, loads it and continues the paused trajectories with it; each
    token's log-prob is the marker of the weights of the version it is stamped with (sync
    indices mapped to policy versions on the trainer), trajectories span versions, none more
    than the cap (rollout.partial_max_updates, else k: a slow batch spans both syncs it
    sees at k = 2, one at cap 1), and no sample is more than k behind."""
    run = _launch(_data(), k, steps=6, start=None, store=dist.HashStore(), train_s=0.05,
                  engine=PartialMarkerEngine, batches=6, partial_cap=cap)
    spans = []
    for version, ros in run["steps"]:
        for ro in ros:
            assert len(ro.completions) == len(ro.prompts) * G
            for c in ro.completions:
                assert len(c.token_ids) == 3 and c.logprobs == [float(v) for v in
                                                                c.token_versions]
                assert c.version == c.token_versions[0] and 0 <= version - c.version <= k
                spans.append(c.token_versions[-1] - c.token_versions[0])
            assert ro.metrics["partial_continued"] >= 0
    assert max(spans) == (cap or k), spans  # paused and continued, within the cap
    assert sum(run["served"][j]["batches"] for j in range(2)) >= 2 * 6


@pytest.mark.parametrize("cap", [0, 1])
def test_multi_turn_partial_rollouts_on_the_rollout_ranks(cap):
    """Multi-turn partial rollouts at separate placement (k = 2): the rollout ranks run the
    environments; at each announced sync a draw pauses trajectories mid-turn and between
    turns, loads the sync and continues them. The trainer gets every trajectory whole and
    equal to the one run without a pause (ids, loss mask, turns, turn rewards: the runner's
    `run`, tests/test_agent_partial.py), each model token stamped with the policy version of
    the weights that sampled it (its log-prob names them), each environment token with none
    (NO_VERSION, log-prob 0: the trainer's version map keeps it), no sample more than k
    behind, none spanning more updates than the cap (rollout.partial_max_updates, else k);
    the batches' metrics count trajectories paused mid-turn and between turns."""
    from tests.test_agent_partial import _runner

    k, prompts = 2, _agent_prompts()
    records = {tuple(p): e.record for p, e in zip(prompts, _agent_data())}
    run = _launch(_agent_data(), k, steps=6, start=None, store=dist.HashStore(), train_s=0.05,
                  engine=AgentPartialEngine, batches=6, partial_cap=cap, agent=True)
    mid = between = continued = 0
    spans = []
    for version, ros in run["steps"]:
        for ro in ros:
            assert len(ro.completions) == len(ro.prompts) * G
            for c in ro.completions:
                p = ro.prompts[c.prompt_index]
                ref = _runner(AgentPartialEngine().rule).run([p], [records[tuple(p)]],
                                                             AGENT_S)[c.sample_index]
                assert (c.token_ids, c.loss_mask, c.turns, c.turn_rewards) == \
                    (ref.token_ids, ref.loss_mask, ref.turns, ref.turn_rewards)
                own = []
                for tok, lp, v, m in zip(c.token_ids, c.logprobs, c.token_versions,
                                         c.loss_mask):
                    if m:
                        assert lp == pytest.approx(-0.01 * (tok + 1) - v, abs=1e-6), (tok, v)
                        own.append(v)
                    else:
                        assert (v, lp) == (NO_VERSION, 0.0)
                assert c.version == min(own) and 0 <= version - c.version <= k
                spans.append(max(own) - min(own))
            mid += ro.metrics["partial_turns_mid"]
            between += ro.metrics["partial_turns_between"]
            continued += ro.metrics["partial_continued"]
    assert mid > 0 and between > 0 and continued > 0, (mid, between, continued)
    assert max(spans) <= (cap or k) and max(spans) > 0, spans


def _seen(run: dict) -> list:
    """Every step's version and, per replica, what it trained: prompts, each completion's
    tokens, log-probs (the first names the weights that sampled it) and version, rewards."""
    return [(version, [(ro.prompts, [(c.token_ids, c.logprobs, c.version, c.prompt_index,
                                      c.sample_index) for c in ro.completions],
                        ro.rewards.tolist(), ro.version) for ro in ros])
            for version, ros in run["steps"]]


@pytest.mark.parametrize("k", [1, 2])
def test_checkpointed_in_flight_state_resumes_bitwise(k):
    """Issue 47: a checkpoint after step 3 holds the rollout ranks' finished parts the trainer
    had not taken (drawn with older weights than the checkpoint's) and each sampler's stream
    and loader position; a new launch from it (the checkpoint's weights, those parts, those
    streams), checkpointed again after one step (at k = 2 a restored part not yet taken is kept
    again) and resumed once more, trains steps 4-6 exactly as the uninterrupted launch did:
    the same prompts, tokens (the last one random), weights that sampled them (the markers),
    versions and rewards. Without the restored state the first batches are drawn again with
    the checkpoint's weights and fresh streams, and differ."""
    data, n = _data() * 2, 6
    # a cold start's sync first: sync indices are not policy versions (the checkpoint maps them)
    whole = _launch(data, k, steps=n, start=None, store=dist.HashStore(),
                    engine=SamplingMarkerEngine, batches=n, settle=True, cold_syncs=1)
    runs, start, state, done = [], None, None, 0
    for steps in (3, 1, 2):
        last = done + steps == n
        runs.append(_launch(data, k, steps=steps, start=start, store=dist.HashStore(),
                            engine=SamplingMarkerEngine, batches=n - done, settle=True,
                            cold_syncs=0 if done else 1, checkpoint=not last, restore=state))
        start, state, done = runs[-1]["loader"], runs[-1]["in_flight"], done + steps
        if not last:
            assert state["max_staleness"] == k and len(state["rollout_ranks"]) == 2
            parts = [unpack(p) for r in state["rollout_ranks"] for p in r["parts"]]
            assert len(parts) >= 2 * (k - 1)  # drawn ahead with older weights, kept
            if done == 4 and k == 2:  # a part restored after step 3 and not yet taken
                assert any(p.batch == 0 and min(c.version for c in p.completions) == 2
                           for p in parts), [(p.batch, p.completions[0].version) for p in parts]
    assert [s for r in runs for s in _seen(r)] == _seen(whole)
    assert [v for v, _ in whole["steps"]] == list(range(n))
    lags = [v - ro.version for v, ros in whole["steps"] for ro in ros]
    assert max(lags) == k  # the stream ran k ahead, so the checkpoints held older samples


def test_in_flight_state_of_another_world_is_not_restored(caplog):
    """A checkpoint of another number of rollout ranks (or another k) is not put back: the
    console says so and the batches drawn ahead are drawn again (the first sync carries no
    state); the same world is restored."""
    source = SimpleNamespace(cfg=_config(1), engine=SimpleNamespace(restore=None),
                             place=SimpleNamespace(cross=object(), rollout_ranks=2))
    part = InFlightState(source, SimpleNamespace(engine_version=3))
    state = {"rollout_ranks": [{"next": 0}], "max_staleness": 1}
    with caplog.at_level("WARNING", logger="megagrpo"):
        part.load_state_dict(state)
    assert source.engine.restore is None
    assert "saved with 1 rollout ranks at rollout.max_staleness=1, now 2 at 1" in caplog.text
    part.load_state_dict(dict(state, rollout_ranks=[{"next": 0}] * 2))
    assert source.engine.restore == [{"next": 0}] * 2
    part.load_state_dict({})  # a training rank other than 0 holds nothing
    assert source.engine.restore == [{"next": 0}] * 2


class DyingMarkerEngine(MarkerEngine):
    """A MarkerEngine whose process dies in its `dies_at`-th draw (counted from 1): that draw and
    every later one raise `EngineLost`, and it drains the weights it is sent (as
    `megagrpo.engine.process.EngineProcess` does); None: never."""

    def __init__(self, dies_at: int | None) -> None:
        super().__init__()
        self.dies_at, self.draws, self.lost = dies_at, 0, None

    def generate(self, prompts, sampling):
        from megagrpo.engine.process import EngineLost

        self.draws += 1
        if self.lost is None and self.dies_at is not None and self.draws >= self.dies_at:
            self.lost = EngineLost(4242, "was killed by signal 9 (SIGKILL)")
        if self.lost is not None:
            raise self.lost
        return super().generate(prompts, sampling)

    def update_weights(self, pairs):
        if self.lost is not None:
            for _ in pairs:
                pass
            return WeightSyncStats(tensors=0, bytes=0, seconds=0.0, source_seconds=0.0,
                                   load_seconds=0.0)
        return super().update_weights(pairs)


@pytest.mark.parametrize("k,dies_at,who", [(0, 3, 1), (1, 2, 1), (1, 2, 0)])
def test_a_failed_engine_is_made_up_by_the_other_rollout_rank(k, dies_at, who, caplog):
    """rollout.engine_failure=continue: rollout rank `who`'s engine dies in its `dies_at`-th
    draw. The rank reports itself out and keeps taking the syncs; every batch the trainer takes
    from then on still holds every prompt of the loader's batch, in order, each group whole and
    sampled by the weights its marker names, the dead rank's share drawn by the other one (a
    make-up part, received after that rank's own part: with `who` = 0 the make-up is of a lower
    rollout index than its sender); the metrics count the rank out and the make-ups, and rank
    0's console names the rank."""
    with caplog.at_level("WARNING", logger="megagrpo"):
        run = _launch(_data(), k, steps=6, start=None, store=dist.HashStore(), batches=6,
                      engine=lambda j: DyingMarkerEngine(dies_at if j == who else None),
                      failover=True)
    reference = PromptLoader(_data(), B, seed=3)
    outs = []
    for version, (ro0, ro1) in run["steps"]:
        want = [int(e.prompt) for e in next(reference)]
        assert [p[-1] for ro in (ro0, ro1) for p in ro.prompts] == want
        for ro in (ro0, ro1):
            assert len(ro.completions) == G * len(ro.prompts)
            for c in ro.completions:
                assert c.token_ids[0] == ro.prompts[c.prompt_index][-1]
                assert c.logprobs[0] == c.version and 0 <= version - c.version <= k
        outs.append((ro0.metrics["rollout_ranks_out"], ro0.metrics["rollout_makeups"]))
    failed = dies_at - 1  # the batch rank 1 did not draw
    assert outs[:failed] == [(0.0, 0.0)] * failed
    assert outs[failed:] == [(1.0, 1.0)] * (6 - failed)
    assert run["served"][who]["batches"] == failed
    assert run["served"][1 - who]["batches"] >= 6
    assert f"rollout rank {2 + who} is out: its engine (pid 4242) was killed by signal 9" \
        in caplog.text


def test_separate_placement_config():
    assert training_world(_config(1).rollout, 3) == 1
    assert training_world(TrainConfig().rollout, 3) == 3
    ok = load_config(None, ["rollout.placement=separate", "rollout.rollout_ranks=1",
                            "data.batch_size=4"])
    ok.validate(3)  # 2 training ranks (DP 2) + 1 rollout rank
    for lifted in (["eval.every=5"], ["cold_start.steps=5"], ["lora.rank=8"],
                   ["lora.rank=8", "lora.refit=merged"], ["lora.rank=8", "lora.refit=adapter"],
                   ["algo.routing_replay=true"],
                   ["agent.environment=tests._agent_env:Digits", "agent.max_turns=3"],
                   ["algo.dynamic_sampling=true"],
                   ["rollout.rollout_ranks=2", "rollout.engine_failure=continue"]):
        load_config(None, ["rollout.placement=separate", "rollout.rollout_ranks=1",
                           "data.batch_size=4", *lifted]).validate(3)
    bad = [
        (["rollout.placement=separate"], "rollout.rollout_ranks=0"),
        (["rollout.rollout_ranks=2"], "rollout.rollout_ranks=2 needs rollout.placement=separate"),
        (["rollout.placement=separate", "rollout.rollout_ranks=1",
          "rollout.tensor_parallel_size=2"], "rollout.tensor_parallel_size=2"),
        (["rollout.placement=sideways"], "rollout.placement='sideways'"),
        (["rollout.engine_failure=continue"], "rollout.engine_failure=continue hands"),
        (["rollout.placement=separate", "rollout.rollout_ranks=1",
          "rollout.engine_failure=continue"], "rollout_ranks >= 2"),
        (["rollout.placement=separate", "rollout.rollout_ranks=2", "rollout.max_staleness=1",
          "rollout.engine_failure=continue", "rollout.inflight_updates=true"],
         "engine_failure=continue does not run with rollout.inflight_updates"),
        (["rollout.placement=separate", "rollout.rollout_ranks=2", "rollout.max_staleness=1",
          "rollout.engine_failure=continue", "rollout.partial_rollouts=true"],
         "engine_failure=continue does not run with rollout.partial_rollouts"),
        (["rollout.placement=separate", "rollout.rollout_ranks=2",
          "rollout.engine_failure=continue", "rollout.tensor_parallel_size=2"],
         "engine_failure=continue does not run with rollout.tensor_parallel_size=2"),
        (["rollout.engine_failure=retry"], "rollout.engine_failure='retry' must be one of"),
    ]
    for overrides, named in bad:
        with pytest.raises(ValueError, match=named.replace("(", r"\(")):
            load_config(None, overrides).validate(3)
    with pytest.raises(ValueError, match="rollout.rollout_ranks=3 leaves no training rank"):
        load_config(None, ["rollout.placement=separate", "rollout.rollout_ranks=3"]).validate(3)


def _gloo_pair(store) -> dict[int, dist.ProcessGroupGloo]:
    """Two gloo ranks over `store` in this process (each made on a thread of its own: the
    constructor waits for its peer)."""
    groups: dict[int, dist.ProcessGroupGloo] = {}
    threads = [threading.Thread(target=lambda r=r: groups.update({r: dist.ProcessGroupGloo(
        store, r, 2, timedelta(seconds=30))})) for r in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return groups


def test_stop_message_carries_no_weights():
    """The stop message carries no weights: the engine is not touched."""
    store = dist.HashStore()
    groups = _gloo_pair(store)
    place = Placement(rank=0, train_world=1, rollout_ranks=1, store=store, cross=groups[0],
                      timeout_s=30)
    remote = RemoteEngine(place=place, loader=PromptLoader(_data(), B), sends=True,
                          bucket_bytes=1 << 20, dtype="float32")
    eng, got = MarkerEngine(), []
    t = threading.Thread(target=lambda: got.append(receive_weights(
        Placement(rank=1, train_world=1, rollout_ranks=1, store=store, cross=groups[1],
                  timeout_s=30), eng)))
    t.start()
    remote.close()
    t.join(timeout=30)
    assert got[0].stop and eng.received == []


class AdapterEngine(MarkerEngine):
    """Keeps the base tensors it is fed and the adapter tensors of every peft folder it loads."""

    max_lora_rank = 8

    def __init__(self) -> None:
        super().__init__()
        self.adapters: list[dict[str, torch.Tensor]] = []

    def update_weights(self, pairs, partial=False):
        self.received.append({n: t.clone() for n, t in pairs})
        return WeightSyncStats(tensors=0, bytes=0, seconds=0.0, source_seconds=0.0,
                               load_seconds=0.0)

    def load_adapter(self, path):
        from safetensors.torch import load_file

        self.adapters.append(load_file(f"{path}/adapter_model.safetensors"))


def test_adapter_only_syncs_over_the_cross_group(tmp_path):
    """An adapter-only LoRA sync to a rollout rank (`collective`'s `deliver_adapter`, the
    header's `adapter` and `base`): the base reaches the engine only when given, the adapter
    tensors every time, bitwise, as the peft folder its engine loads; the trainer reports the
    base's bytes (0 without one) and the adapter rides in the same sync (one index each)."""
    from megagrpo.config.lora import LoRAConfig
    from megagrpo.sync.source import Feed
    from megagrpo.sync.transports.collective import deliver_remote_adapter

    store = dist.HashStore()
    groups = _gloo_pair(store)
    place = Placement(rank=0, train_world=1, rollout_ranks=1, store=store, cross=groups[0],
                      timeout_s=30)
    remote = RemoteEngine(place=place, loader=PromptLoader(_data(), B), sends=True,
                          bucket_bytes=1000, dtype="float32")
    rollout = Placement(rank=1, train_world=1, rollout_ranks=1, store=store, cross=groups[1],
                        timeout_s=30, lora=LoRAConfig(rank=4), adapter_dir=tmp_path / "ad")
    eng, got = AdapterEngine(), []
    t = threading.Thread(target=lambda: got.extend(receive_weights(rollout, eng)
                                                   for _ in range(3)))
    t.start()
    g = torch.Generator().manual_seed(0)
    sent, out = [], []
    for base in (True, False, False):
        adapters = {f"base_model.model.model.layers.0.self_attn.q_proj.lora_{ab}.weight":
                    torch.randn(shape, generator=g) for ab, shape in (("A", (4, 30)),
                                                                      ("B", (40, 4)))}
        sent.append(adapters)
        feed = Feed(iter(_weights(len(out)))) if base else None
        out.append(deliver_remote_adapter(Collective(remote), feed, adapters))
    t.join(timeout=30)
    assert [s.index for s in got] == [0, 1, 2] and remote.syncs == 3
    assert len(eng.received) == 1  # the base once, bitwise
    assert all(torch.equal(eng.received[0][n], w) for n, w in _weights(0))
    assert [out_["sync_bytes"] > 0 for out_ in out] == [True, False, False]
    assert len(eng.adapters) == 3
    for loaded, adapters in zip(eng.adapters, sent):
        assert loaded.keys() == adapters.keys()
        assert all(torch.equal(loaded[n], w) for n, w in adapters.items())


# ---------------------------------------------------------------------- real processes
ARGS = [
    "model.vocab_size=19", "model.hidden_size=64", "model.ffn_hidden_size=128",
    "model.num_layers=2", "model.num_attention_heads=4", "model.num_query_groups=2",
    "model.head_dim=32", "model.max_position_embeddings=64",
    "parallel.make_vocab_size_divisible_by=16", "optim.lr=1e-3", "rollout.max_tokens=6",
    "rollout.max_model_len=64", "algo.group_size=4", "algo.beta=0.05", "data.batch_size=4",
    "arithmetic.num_train=64", "arithmetic.num_eval=8", "compute.micro_batch_size=8",
    "compute.kernel_impl=torch", "log.progress=false", "log.tensorboard=false",
    "reward.terms=[{name: 'tests._rewards:length_reward'}]",
    "rollout.placement=separate", "rollout.rollout_ranks=1", "rollout.max_staleness=1",
    "run.steps=3",
]


@pytest.fixture(scope="module")
def separate_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("separate")
    # a checkpoint after step 2: the rollout rank's in-flight state is asked for while it
    # draws on its in-flight thread (the message waits for the draw, no deadlock)
    # on two loopback "nodes" (examples/launch_multinode.sh): a training node of 2 ranks and a
    # rollout node of 1, the weights and the samples crossing between them
    recipe = work / "recipe.yaml"
    recipe.write_text("run: {steps: 3}\n")
    console = "".join(run_loopback_nodes(
        recipe, (2, 1), *ARGS, "rollout.inflight_updates=true", "checkpoint.every=2",
        f"run.out_dir={work}/run", f"arithmetic.tokenizer_dir={work}/tok"))
    records = [json.loads(line) for line in Path(work, "run", "metrics.jsonl").read_text()
               .splitlines()]
    state = load_tree(Path(work, "run", "checkpoints", "step_000002", "rollout_ranks",
                           "rank00000.safetensors"))
    assert len(state["rollout_ranks"]) == 1 and state["rollout_ranks"][0]["rng"]
    return console, [r for r in records if "loss" in r]


def test_separate_run_trains(separate_run):
    console, steps = separate_run
    assert "placement: separate; training ranks 0-1 (megatron-core tp=1 x pp=1 x dp=2), " \
           "rollout ranks 2-2 (one vLLM engine of TP 1 each" in console
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert r["update_skipped"] == 0 and r["grad_norm"] > 0
        assert all(map(torch.isfinite, torch.tensor([r["loss"], r["reward_mean"]])))
        assert r["sync_bytes"] > 0
    assert "loaded between decode steps (in flight)" in console


def test_separate_run_versions_and_gap(separate_run):
    _, steps = separate_run
    # the first batch is sampled by the weights that train on it: vLLM on the rollout rank and
    # the trainer agree to fp32 precision (after the weights crossed the gloo group)
    assert steps[0]["staleness_max"] == 0 and steps[0]["logp_gap_vllm_mean"] < 1e-5
    # the run ends on-policy (the last batch at k = 0): after every sync crossed the wire,
    # vLLM's weights are still the trainer's (a skipped or garbled sync fails here)
    assert steps[-1]["staleness_max"] == 0 and steps[-1]["logp_gap_vllm_mean"] < 1e-5
    assert all(r["staleness_max"] <= 1 for r in steps)  # per-sample lags, k = 1
    # in flight: per-token lags, trainer versions (sync indices mapped), within the bound
    assert all(0 <= r["token_lag_mean"] <= 1 for r in steps)
    assert any(r["staleness_max"] == 1 for r in steps)  # and the stream did run ahead


TOOLS = Path(__file__).resolve().parents[1] / "examples" / "tools-demo.yaml"
AGENT_ARGS = [
    "--config", str(TOOLS), "model.hidden_size=64", "model.ffn_hidden_size=128",
    "model.num_layers=2", "model.head_dim=32", "run.steps=3", "data.batch_size=4",
    "algo.group_size=4", "algo.num_minibatches=1", "cold_start.steps=0", "eval.every=0",
    "arithmetic.num_eval=4", "arithmetic.num_train=64", "compute.micro_batch_size=16",
    "compute.kernel_impl=torch", "log.tensorboard=false", "log.progress=false",
    "reward.source=tests._fault_hooks:TrajectoryLog", "rollout.max_staleness=0",
    "algo.dynamic_sampling=true",
]


AGENT_LAUNCHES = {
    "colocated": ("1", []),
    "separate": ("2", ["rollout.placement=separate", "rollout.rollout_ranks=1"]),
    "separate_tp2": ("3", ["rollout.placement=separate", "rollout.rollout_ranks=2",
                           "rollout.tensor_parallel_size=2"]),
}
"""The multi-turn pair's launches: nproc and placement (each with LoRA served by vLLM)."""


def _agent_run(tmp_path_factory, name: str) -> tuple[list, list[dict], str]:
    """The calculator tool task (multi-turn: a turn ending in `</calc>` is answered by the
    environment, its tokens masked out of the loss) on a tiny random model with LoRA (the
    adapters served by vLLM, lora.refit=adapter), 3 steps at k = 0 with dynamic sampling (a
    0/1 reward: groups without spread are topped up), launched as `AGENT_LAUNCHES[name]`
    says: colocated on 1 rank, or 1 training rank + a rollout engine of TP 1 or 2, where the
    environments, the reward and the top-ups run on the rollout ranks. The reward source logs
    every sample it scores (`tests._fault_hooks.TrajectoryLog`; at separate placement the
    engine's leader, the first rollout rank). Returns (the samples of each scoring call,
    per-step metrics, console)."""
    from tests._fault_hooks import TRAJECTORY_LOG_ENV

    nproc, more = AGENT_LAUNCHES[name]
    work = tmp_path_factory.mktemp(f"agent_{name}")
    (work / "log").mkdir()
    p = run_cli("train", "--nproc", nproc, *AGENT_ARGS, *more, "lora.rank=8",
                "lora.refit=adapter", f"run.out_dir={work}/run",
                f"arithmetic.tokenizer_dir={work}/tok", timeout=900,
                **{TRAJECTORY_LOG_ENV: str(work / "log")})
    console = p.stdout + p.stderr
    assert p.returncode == 0, console[-6000:]
    logs = sorted((work / "log").glob("rank*.jsonl"))
    assert [f.name for f in logs] == [f"rank{0 if nproc == '1' else 1}.jsonl"]
    calls = [json.loads(line) for line in logs[0].read_text().splitlines()]
    records = [json.loads(line) for line in Path(work, "run", "metrics.jsonl").read_text()
               .splitlines()]
    return calls, [r for r in records if "loss" in r], console


@pytest.fixture(scope="module")
def agent_colocated(tmp_path_factory):
    return _agent_run(tmp_path_factory, "colocated")


@pytest.fixture(scope="module")
def agent_separate(tmp_path_factory):
    return _agent_run(tmp_path_factory, "separate")


@pytest.fixture(scope="module")
def agent_separate_tp2(tmp_path_factory):
    return _agent_run(tmp_path_factory, "separate_tp2")


def _equal_to_colocated(col: tuple, sep: tuple) -> None:
    """Multi-turn rollouts, LoRA and dynamic sampling at separate placement are the colocated
    run's for the same seeds (k = 0: the rollout ranks draw every top-up with the weights of
    the step it tops up, in the order the colocated collector draws them): every trajectory's
    token ids, loss mask, turn rewards and ends (the evaluations' greedy ones, every step's
    batch and its top-ups, in order) are equal, and so is what the trainer made of them (the
    kept groups' turns, tool calls, environment tokens, rewards, the top-up rounds and
    filtered groups; the loss to fp32 rounding: the two trainers are the same single-rank
    math). The weights that sampled each batch are the trainer's (vLLM gap < 1e-5 over the
    model's tokens, the adapters served by vLLM), so the samples of steps 2 and 3 check that
    the trained adapters crossed the wire."""
    calls = col[0]  # evaluation before GRPO, each step's batch and top-ups, evaluation at end
    rounds = [r["resample_rounds"] for r in col[1]]
    # 4 held-out, 4 prompts x G=4 per draw
    assert [len(c) for c in calls] == [4] + [16] * (3 + sum(rounds)) + [4], rounds
    assert sum(rounds) >= 1, rounds  # some step was topped up
    multi = [s for c in calls for s in c if s[2] is not None and not all(s[2])]
    assert len(multi) >= 4, calls  # trajectories with environment tokens
    # evaluations and draws, each in order: the rollout rank draws batch 1 as soon as the
    # first sync is in (k = 0: its weights are step 1's), before or after it is asked for the
    # evaluation before GRPO with the same weights (greedy, the sampler's streams left as found:
    # either order gives the same tokens); and it may draw one batch past the last (with the
    # last sync, while the trainer evaluates and before its stop; never trained)
    evals, draws = ([c for c in calls if len(c) == n] for n in (4, 16))
    sep_evals, sep_draws = ([c for c in sep[0] if len(c) == n] for n in (4, 16))
    assert len(sep_evals) + len(sep_draws) == len(sep[0])
    assert sep_evals == evals
    assert sep_draws[:len(draws)] == draws and len(sep_draws) - len(draws) in (0, 1)
    assert [r["step"] for r in sep[1]] == [r["step"] for r in col[1]] == [1, 2, 3]
    for a, b in zip(sep[1], col[1]):
        for key in ("turns", "tool_calls", "tool_errors", "env_token_share", "reward_mean",
                    "completion_len", "resample_rounds", "filtered_groups",
                    "sync_adapter_bytes"):
            assert a[key] == b[key], (key, a[key], b[key])
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
        assert a["staleness_max"] == 0 and a["logp_gap_vllm_mean"] < 1e-5, a
    assert "vLLM serves the adapters (LoRA request per rollout)" in sep[2]


def test_separate_multi_turn_equals_colocated_at_a_tp2_engine(agent_colocated,
                                                               agent_separate_tp2):
    """`_equal_to_colocated`, the rollout ranks forming one vLLM engine of TP 2 (both ranks run
    the environments; the leader counts the top-ups for both and sends the samples): its
    sampled tokens are the TP 1 engine's for the same seeds."""
    sep = agent_separate_tp2
    assert "rollout ranks 1-2 (1 vLLM engine(s) of TP 2, each over 2 consecutive rollout " \
           "ranks" in sep[2]
    _equal_to_colocated(agent_colocated, sep)


@pytest.mark.heavy  # ~35 s more: the TP 2 engine's pair above runs the same protocol
def test_separate_multi_turn_equals_colocated(agent_colocated, agent_separate):
    """`_equal_to_colocated`, with one rollout rank (an engine of TP 1)."""
    assert "rollout ranks 1-1 (one vLLM engine of TP 1 each" in agent_separate[2]
    _equal_to_colocated(agent_colocated, agent_separate)


@pytest.fixture(scope="module")
def separate_lora_run(tmp_path_factory):
    """One launch of the tiny dense model at separate placement (2 training ranks DP=2 + 1
    rollout rank, k = 0, 3 steps) with LoRA on all four targets served by the rollout rank's
    vLLM (lora.refit=adapter) and delta syncs (rollout.sync_delta): the reference resets after
    step 2, merging the adapters into the base."""
    work = tmp_path_factory.mktemp("separate_lora")
    p = run_cli("train", "--nproc", "3", *ARGS, "rollout.max_staleness=0", "lora.rank=8",
                "lora.refit=adapter", "reference.sync_every_steps=2", "rollout.sync_delta=true",
                "optim.lr=1e-2", f"run.out_dir={work}/run",
                f"arithmetic.tokenizer_dir={work}/tok", timeout=900)
    console = p.stdout + p.stderr
    assert p.returncode == 0, console[-6000:]
    records = [json.loads(line) for line in Path(work, "run", "metrics.jsonl").read_text()
               .splitlines()]
    logs = "".join(f.read_text() for f in sorted(Path(work, "run", "logs").glob("rank*.log")))
    hf = json.loads(Path(work, "run", "engine", "rank2", "config.json").read_text())
    return console + logs, [r for r in records if "loss" in r], hf


def _linear_bytes(hf: dict) -> int:
    """fp32 bytes of every layer's q/k/v/o and gate/up/down weights (what a merge edits),
    counted from the engine's HF config by hand."""
    H, F, L = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"]
    hd = hf.get("head_dim") or H // hf["num_attention_heads"]
    q, kv = hf["num_attention_heads"] * hd, hf["num_key_value_heads"] * hd
    return 4 * L * (H * (q + 2 * kv) + q * H + 3 * F * H)


def test_separate_lora_adapter_and_delta_sync(separate_lora_run):
    """LoRA at separate placement, adapter-only: every step samples fresh (k = 0) from the
    rollout rank's vLLM serving the adapters it was sent, within fp32 precision of the
    trainer (step 2 with trained adapters, step 3 after step 2's merge, whose base crossed as
    a delta). What crossed, counted on both sides against bytes counted by hand: the syncs of
    steps 1 and 3 the peft adapter alone; step 2's the merged linears (the delta: embeddings,
    norms and the output layer, frozen, not re-sent) plus the adapter; the first sync the
    whole base."""
    from tests.test_lora_run import _peft_adapter_bytes

    console, steps, hf = separate_lora_run
    assert "vLLM serves the adapters (LoRA request per rollout): refits carry the adapters, " \
           "the base only after a merge" in console
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["staleness_max"] for r in steps] == [0, 0, 0]
    assert all(r["logp_gap_vllm_mean"] < 1e-5 for r in steps), \
        [r["logp_gap_vllm_mean"] for r in steps]
    assert "step 2: reference re-initialised (" in console and steps[1]["kl"] > 0
    adapter, linears = _peft_adapter_bytes(hf, 8), _linear_bytes(hf)
    assert [r["sync_adapter_bytes"] for r in steps] == [adapter] * 3
    assert [r["sync_base"] for r in steps] == [0.0, 1.0, 0.0]
    assert [r["sync_bytes"] for r in steps] == [adapter, linears + adapter, adapter]
    got = [tuple(map(int, m)) for m in re.findall(
        r"rollout rank 2: adapter sync (\d+) received (\d+) bytes of the base and (\d+) of "
        r"the adapters", console)]
    assert [s for s, _, _ in got] == [0, 1, 2, 3], got
    assert [a for _, _, a in got] == [adapter] * 4
    base = [b for _, b, _ in got]
    assert base[1] == base[3] == 0 and base[2] == linears < base[0], got


DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.yaml"
MOE_ARGS = [
    "--config", str(DEMO), "--nproc", "3", "run.steps=3", "data.batch_size=4",
    "algo.group_size=4", "algo.num_minibatches=1", "reference.sync_every_steps=2",
    "cold_start.steps=2", "cold_start.batch_size=8", "eval.every=2", "arithmetic.num_eval=8",
    "log.tensorboard=false",
    "log.progress=false", "compute.micro_batch_size=16", "compute.kernel_impl=torch",
    "reward.terms=[{name: arithmetic}, {name: 'tests._rewards:length_reward', weight: 0.01}]",
    "rollout.placement=separate", "rollout.rollout_ranks=1", "rollout.max_staleness=0",
    "algo.routing_replay=true", "lora.rank=8", "lora.targets=[qkv, proj]", "optim.lr=1e-2",
]


@pytest.fixture(scope="module")
def separate_moe_run(tmp_path_factory):
    """One launch of a tiny Qwen3-MoE at separate placement (2 training ranks DP=2 + 1 rollout
    rank, k = 0, 3 steps), shared by the features it composes with: routing replay (the routes
    vLLM chose on the rollout rank travel back with the samples and the trainer's forwards
    replay them), LoRA on qkv and proj (the rollout rank is sent the merged weights; the
    reference resets after step 2, merging the adapters into the base), held-out
    evaluation on the rollout rank's engine (before and after the cold start, after step 2
    and at the end) and a 2-step supervised cold start, during which the rollout rank loads
    the syncs but draws nothing (step 1's samples come from the cold-started weights)."""
    from tests.support.tiny import tiny_qwen3_moe

    work = tmp_path_factory.mktemp("separate_moe")
    tiny_qwen3_moe(work / "qwen3_moe")
    return (*train_logged(work / "run", *MOE_ARGS, f"run.init={work}/qwen3_moe"), work)


def test_separate_routing_replay(separate_moe_run):
    """Every step's samples are fresh (k = 0) and the trainer replays the experts vLLM chose
    on the rollout rank: its log-probs equal vLLM's to fp32 precision (the colocated replay
    test's bound) and its own routing agrees with the replayed one everywhere, no replayed
    row missing (routes lost or misaligned on the wire fail here)."""
    _, steps, _ = separate_moe_run
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert r["staleness_max"] == 0 and r["update_skipped"] == 0
        assert r["logp_gap_vllm_mean"] < 1e-5, [s["logp_gap_vllm_mean"] for s in steps]
        assert r["moe_routing_mismatch"] == 0.0 and r["moe_replay_missing"] == 0.0, r


def test_separate_lora_merged_refit(separate_moe_run):
    """LoRA at separate placement: the rollout rank samples from W + s B A. Step 2 samples
    with trained adapters (B != 0 after step 1), step 3 after the merge of step 2's reference
    reset; both at k = 0 with the trainer's log-probs to fp32 precision (step 1: the weights
    the cold start ended at)."""
    console, steps, work = separate_moe_run
    assert "vLLM is refit with the merged weights (W + s B A) after each update (no " \
           "adapter-only refit: an MoE model on vLLM's CPU build, whose experts run through " \
           "Triton kernels it lacks once LoRA is on)" in console
    assert [r["logp_gap_vllm_mean"] < 1e-5 for r in steps] == [True] * 3, \
        [r["logp_gap_vllm_mean"] for r in steps]
    assert "step 2: reference re-initialised (" in console
    # the adapters moved the policy away from the base it started from
    assert steps[1]["kl"] > 0


def test_separate_held_out_evaluation_reported(separate_moe_run):
    """The rollout rank's evaluations land where a colocated run's do: metrics records at
    step 0 (before GRPO), after step 2 (eval.every) and at the end, and the summary's
    fields, the cold start's check included; each a share of the 8 held-out examples (tests
    above count it by hand). The cold start ran before GRPO on the training ranks while the
    rollout rank waited: step 1's samples are fresh (gap < 1e-5, checked above), i.e. from
    the cold-started weights (test_cold_start_holds_the_rollout_ranks plants the early draw)."""
    console, _, work = separate_moe_run
    records = [json.loads(line) for line in Path(work, "run", "metrics.jsonl").read_text()
               .splitlines()]
    evals = [(r["step"], r["eval_accuracy"]) for r in records if "eval_accuracy" in r]
    assert [s for s, _ in evals] == [0, 2, 3], evals
    assert all(a * 8 == round(a * 8) and 0 <= a <= 1 for _, a in evals), evals
    summary = json.loads(Path(work, "run", "summary.json").read_text())
    assert summary["eval_accuracy_before"] == evals[0][1]
    assert summary["eval_accuracy_after"] == evals[-1][1]
    assert summary["sft_steps"] == 2 and 0 <= summary["sft_eval_accuracy"] <= 1
    assert "held-out evaluation: 8 prompts, greedy" in console
    assert re.search(r"rollout rank 2: \d+ batches sampled over \d+ weight syncs, 5 held-out "
                     "evaluations", console), console[-3000:]


def test_plan_separates_training_and_rollout_memory(capsys):
    """A training rank holds no vLLM share (its peak is the colocated one less that share);
    a rollout rank holds the whole model (fp32 bytes of every parameter) plus its KV cache."""
    from megagrpo.plan import GIB, plan_model, rank_memory, run_plan, total_params

    over = ["parallel.tp=2", "rollout.placement=separate", "rollout.rollout_ranks=1"]
    sep = load_config(None, over)
    col = load_config(None, over[:1])
    m, _ = plan_model(sep)
    a, b = rank_memory(sep, m, 2, 1, 2, 80.0), rank_memory(col, m, 2, 1, 2, 80.0)
    assert a.vllm == 0 and b.vllm == int(0.5 * 80 * GIB)
    assert a.update_peak == b.update_peak - b.vllm
    run_plan(None, over, gpus=3)
    out = capsys.readouterr().out
    assert "separate placement: 2 training rank(s) (ranks 0-1) + 1 rollout rank(s) (ranks 2-2)" \
        in out
    assert f"weights {total_params(m) * 4 / GIB:.2f} GiB (the whole model)" in out
    # engines of TP 2 over 4 rollout ranks: each rank holds half of every sharded tensor, the
    # norms (2 per layer and the final one) whole
    run_plan(None, [*over[:2], "rollout.rollout_ranks=4", "rollout.tensor_parallel_size=2"],
             gpus=6)
    out = capsys.readouterr().out
    norms = (2 * m.num_layers + 1) * m.hidden_size
    half = ((total_params(m) - norms) // 2 + norms) * 4
    assert "rollout rank: 1 of the 2 rank(s) of one of 2 vLLM engine(s) of TP 2" in out
    assert f"weights {half / GIB:.2f} GiB (1/2 of the model's sharded tensors)" in out


def _stopped_and_resumed(tmp_path, more: list[str], first: list[str]) -> list[dict]:
    """ARGS + `more` at separate placement (3 ranks): 2 steps (+ `first`), then a resumed
    launch to step 4 in the same folder; the 4 step records (asserted 1-4)."""
    args = [*ARGS, *more, f"run.out_dir={tmp_path}/run", f"arithmetic.tokenizer_dir={tmp_path}/tok"]
    for extra in (["run.steps=2", *first], ["run.steps=4", "run.resume=true"]):
        p = run_cli("train", "--nproc", "3", *args, *extra, timeout=900)
        assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    steps = [json.loads(line) for line in Path(tmp_path, "run", "metrics.jsonl").read_text()
             .splitlines()]
    steps = [r for r in steps if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    return steps


@pytest.mark.heavy
def test_separate_run_resumes_at_the_first_untrained_batch(tmp_path):
    """2 steps and a checkpoint, then a resumed launch to step 4: the rollout ranks start at
    the trainer's next batch (a mismatch stops the run) with the checkpoint's weights, so the
    first step after the resume trains samples of its own version."""
    steps = _stopped_and_resumed(tmp_path, [], ["checkpoint.at_end=true"])
    assert steps[2]["staleness_max"] == 0 and steps[2]["logp_gap_vllm_mean"] < 1e-5
    assert all(r["staleness_max"] <= 1 and r["update_skipped"] == 0 for r in steps)


@pytest.mark.heavy  # ~1 min: two launches of 3 ranks
def test_separate_partial_rollouts_checkpoint_and_resume(tmp_path):
    """Partial rollouts on the rollout rank (k = 1) with a checkpoint every step: the trainer
    asks for the in-flight state while the rank may be continuing a paused batch (served once
    the batch is whole); killed nowhere, the run stops after step 2 and a resumed launch
    continues from its checkpoint (the rollout rank's streams and queue put back) to step 4.
    Every step trains at most k = 1 version behind; the steps that sampled fresh match vLLM."""
    steps = _stopped_and_resumed(tmp_path, ["rollout.partial_rollouts=true",
                                            "checkpoint.every=1"], [])
    assert all(r["staleness_max"] <= 1 and r["update_skipped"] == 0 for r in steps)
    assert all(r["logp_gap_vllm_mean"] < 1e-5 for r in steps if r["staleness_max"] == 0)
    assert all("partial_recomputed_tokens" in r for r in steps)
    state = load_tree(Path(tmp_path, "run", "checkpoints", "step_000004", "rollout_ranks",
                           "rank00000.safetensors"))
    assert state["rollout_ranks"][0]["next"] == 0  # the run's end: nothing left queued


def test_longtail_summary_of_the_separate_run(separate_run, tmp_path):
    """benchmarks/longtail.py's figures from this run's metrics (separate placement, in-flight
    updates, k = 1: its separate-k1-inflight configuration, here at DP=2), in place of a run
    of its own (tests/test_longtail_bench.py launches one under -m heavy): the summary of the
    steps after the first and the table row it renders."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "bench_longtail", Path(__file__).resolve().parents[1] / "benchmarks" / "longtail.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    _, steps = separate_run
    r = bench.summarize(steps, dp=2)
    assert r["steps_kept"] == len(steps) - 1 and len(r["reward_curve"]) == len(steps)
    assert r["gen_tokens_per_s"] > 0 and r["trained_tokens_per_s"] <= r["gen_tokens_per_s"]
    assert 1 <= r["completion_len"] <= 6  # rollout.max_tokens
    # the steps after the first train batches sampled at most k = 1 version behind
    assert 0.0 <= r["lag_mean"] <= r["lag_max"] <= 1.0 and r["stale_dropped"] == 0
    assert r["phases"]["time_update"] > 0 and "time_weight_sync" in r["phases"]
    rec = dict(r, config="separate-k1-inflight", seed=0, steps=len(steps), nproc=3, cpu="cpu",
               cores=2, loadavg_1m_start=1.0, loadavg_1m_end=1.0, eval_accuracy=None)
    out = tmp_path / "r.jsonl"
    out.write_text(json.dumps(dict(rec, config="colocated-sync")) + "\n" + json.dumps(rec) + "\n")
    text = bench.table(out)
    assert "| separate-k1-inflight | 0 |" in text and "| 8 | 4 |" in text
