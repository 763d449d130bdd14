"""Partial rollouts in the colocated stream (rollout.partial_rollouts), no vLLM and no ranks: a
fake engine with the real engine's pause contract stands in inside the real `RolloutCollector`.

Each prompt's completion is 1 + (id % 7) tokens long. On the side thread, while a batch is
queued, a call samples up to 3 tokens per trajectory, then waits for the pause that `join` sets
(the weight update), pauses the trajectories below the cap and samples the rest to their end;
with the queue empty, and on the main thread (a batch whose turn to train has come), it samples
to the end. So every other window continues a queued batch across an update. Checked over 10
steps at k = 2, without a cap and at rollout.partial_max_updates = 1: every trained completion
is whole and its token versions those of the windows that sampled it (non-decreasing, at most
k behind the trainer, spanning at most the cap, and 2 updates without one); every prompt is
trained once, in the loader's order; a batch is scored only when whole (its reward is of the
whole completion). The real engine: tests/test_partial_rollout.py; in the trainer:
tests/_partial_check.py.
"""
from __future__ import annotations

import threading
import time

import pytest

from megagrpo.config.layout import RolloutLayout
from megagrpo.data import Example, PromptLoader
from megagrpo.engine.partial import PartialResult, first_version
from megagrpo.reward import Rewards
from megagrpo.rollout.collect import RolloutCollector
from tests.test_stream import Reward, Tok, _config

PER_WINDOW = 3


def length(prompt: list[int]) -> int:
    return 1 + prompt[-1] % 7


class PausingEngine:
    """The engine's partial-rollout contract (`VLLMEngine.generate_partial`) without vLLM: token
    i of a trajectory is 10 + i, its log-prob -version."""

    def __init__(self):
        self.calls = 0
        self.collector: RolloutCollector | None = None
        self.waiting = threading.Event()
        """Set while a call waits for the pause (the draw can go no further this window)."""

    def generate_partial(self, prompts, trajs, sampling, *, version, pause=None,
                         max_updates=0) -> PartialResult:
        self.calls += 1
        side = threading.current_thread() is not threading.main_thread()
        held = [t for t in trajs if pause is not None and pause.is_set()
                and version - first_version(t, version) < max_updates]
        run = [t for t in trajs if all(t is not h for h in held)]
        if side and pause is not None and not pause.is_set() and self.collector.queue:
            for t in run:
                self._sample(t, prompts, version, PER_WINDOW)
            self.waiting.set()
            assert pause.wait(30), "join never set the pause"
            self.waiting.clear()
            held = [t for t in run if not t.finish_reason
                    and version - first_version(t, version) < max_updates]
            run = [t for t in run if all(t is not h for h in held)]
        for t in run:
            self._sample(t, prompts, version, None)
        return PartialResult([t for t in trajs if t.finish_reason],
                             [t for t in trajs if not t.finish_reason], 0, 0)

    @staticmethod
    def _sample(t, prompts, version, most):
        want = length(prompts[t.prompt_index])
        n = want - len(t.token_ids) if most is None else min(most, want - len(t.token_ids))
        for _ in range(n):
            t.token_ids.append(10 + len(t.token_ids))
            t.logprobs.append(-float(version))
            t.token_versions.append(version)
        if len(t.token_ids) == want:
            t.finish_reason = "stop"


class LengthReward(Reward):
    """1 when the completion is whole (its length from the prompt's id)."""

    def score(self, samples):
        import torch

        from megagrpo.reward import Scores

        r = torch.tensor([float(len(s.completion_ids) == length(s.prompt_ids))
                          for s in samples])
        return Scores(rewards=r, per_term={"r": r}, correct=r >= 1)


def _collector(k: int, cap: int, n_prompts: int = 40, batch: int = 2) -> RolloutCollector:
    data = [Example(prompt=str(100 + i), answer=str(100 + i)) for i in range(n_prompts)]
    cfg = _config(k, partial_rollouts=True, partial_max_updates=cap)
    engine = PausingEngine()
    engine.collector = RolloutCollector(
        cfg=cfg, engine=engine, tokenizer=Tok(), rewards=Rewards(LengthReward()),
        loader=PromptLoader(data, batch, seed=3),
        layout=RolloutLayout(rank=0, world_size=1, engine_tp=1, train_tp=1, train_pp=1))
    return engine.collector


def _train(c: RolloutCollector) -> None:
    """The step's training time: until the side thread can go no further (it waits for the
    pause, or it ended), so the windows do not depend on thread timing."""
    deadline = time.monotonic() + 30
    while (c.thread is not None and c.thread.is_alive() and not c.engine.waiting.is_set()
           and time.monotonic() < deadline):
        time.sleep(0.001)


def _run(k: int, cap: int, steps: int = 10):
    c = _collector(k, cap)
    order = PromptLoader([Example(prompt=str(100 + i), answer=str(100 + i)) for i in range(40)],
                         2, seed=3)
    trained, version = [], 0
    for _ in range(steps):
        ro = c.next(version)
        trained.append((version, ro))
        _train(c)
        c.join()  # the pause, then the weight update
        version += 1
    return trained, [[int(e.prompt) for e in next(order)] for _ in range(steps)]


@pytest.mark.parametrize("cap", [0, 1])
def test_trained_batches_are_whole_and_stamped_by_window(cap):
    k = 2
    trained, want = _run(k, cap)
    spans = []
    for version, ro in trained:
        assert ro.rewards.tolist() == [1.0] * len(ro.completions)  # scored whole
        for comp in ro.completions:
            v = comp.token_versions
            assert len(comp.token_ids) == length(ro.prompts[comp.prompt_index]) == len(v)
            assert v == sorted(v) and comp.version == v[0]
            assert comp.logprobs == [-float(x) for x in v]
            assert 0 <= version - v[0] <= k
            spans.append(v[-1] - v[0])
    assert max(spans) == (cap or k)
    # every prompt trained once, in the loader's order
    assert [[p[-1] for p in ro.prompts] for _, ro in trained] == want


def test_the_join_returns_with_the_draw_paused():
    """After the join of the first step the second batch drawn ahead holds paused trajectories
    (3 tokens at most, version 0) and no reward was asked for it yet; the next step's side
    thread continues it with version 1."""
    c = _collector(2, 0)
    c.next(0)
    _train(c)
    c.join()
    assert len(c.queue) == 2 and not c.queue[0].unfinished  # the first ran free
    drawn = c.queue[1]
    assert drawn.unfinished and drawn.pending is None
    assert all(t.token_versions == [0] * len(t.token_ids) and len(t.token_ids) <= PER_WINDOW
               for t in drawn.unfinished)
    c.next(1)
    _train(c)
    c.join()
    assert c.queue[0] is drawn
    assert any(1 in t.token_versions for t in drawn.completions + drawn.unfinished)
