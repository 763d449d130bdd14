"""Multi-turn runner without vLLM: a deterministic fake engine and small environments. The
reference is an independent replay of the trajectory from the fake engine's rule."""
from __future__ import annotations

import logging

import pytest
import torch

from megagrpo.agent import Environment, Observation, Turn
from megagrpo.agent.runner import TrajectoryRunner, agent_metrics, environment_class
from megagrpo.config.agent import AgentConfig
from megagrpo.engine import Completion, SamplingSettings
from megagrpo.parallel.batch import pack

VOCAB = 50


def sample(prefix: list[int], j: int, max_tokens: int, length: int) -> tuple[list[int], str]:
    """The fake engine's rule: `length` ids derived from the prefix and the sample index,
    cut at max_tokens."""
    seed = (sum((i + 1) * t for i, t in enumerate(prefix)) + 7 * j) % 997
    ids = [(seed + 13 * k) % VOCAB for k in range(length)]
    return (ids[:max_tokens], "length") if length > max_tokens else (ids, "stop")


class FakeEngine:
    def __init__(self, length: int = 4):
        self.length, self.calls = length, []

    def generate(self, prompts, sampling):
        self.calls.append(([list(p) for p in prompts], sampling))
        out = []
        for i, p in enumerate(prompts):
            for j in range(sampling.n):
                ids, fin = sample(list(p), j, sampling.max_tokens, self.length)
                out.append(Completion(prompt_index=i, sample_index=j, token_ids=ids,
                                      logprobs=[-0.01 * (t + 1) for t in ids],
                                      finish_reason=fin, text=""))
        return out


class Tok:
    bos_id = None

    def encode(self, text):
        return [VOCAB + int(x) for x in text.split()]

    def decode(self, ids):
        return " ".join(map(str, ids))


class Counter(Environment):
    """Answers each turn with the counter as text; done after 3 turns."""

    def step(self, turn: Turn) -> Observation:
        if turn.index == 2:
            return Observation(done=True, reward=1.0)
        return Observation(text=f"{turn.index} {self.record['k']}", reward=0.5, tool_calls=1,
                           tool_errors=turn.index, tool_seconds=0.25)


class Endless(Environment):
    def step(self, turn: Turn) -> Observation:
        return Observation(token_ids=(VOCAB + 9,) * 3, reward=float(turn.index))


class Raising(Environment):
    def step(self, turn: Turn) -> Observation:
        if self.record["k"] == 1 and turn.index == 1:
            raise RuntimeError("tool server down")
        return Counter.step(self, turn)


def run(env, *, G=2, max_tokens=8, length=4, prompts=((1, 2, 3), (4, 5)), **agent):
    eng = FakeEngine(length)
    cfg = AgentConfig(environment="x:y", **agent)
    runner = TrajectoryRunner(engine=eng, tokenizer=Tok(), agent=cfg, max_model_len=64,
                              factory=lambda rec: env(rec, Tok()))
    s = SamplingSettings(max_tokens=max_tokens, n=G)
    comps = runner.run([list(p) for p in prompts], [{"k": i} for i in range(len(prompts))], s)
    return comps, eng, runner


def test_token_sequence_masks_and_calls():
    comps, eng, _ = run(Counter)
    assert len(comps) == 4 and len(eng.calls) == 3  # one generate call per turn
    assert eng.calls[0][1].n == 2 and all(c[1].n == 1 for c in eng.calls[1:])
    prompts = [[1, 2, 3], [4, 5]]
    for c in comps:
        seq, mask, lps, want_prefixes = list(prompts[c.prompt_index]), [], [], []
        for turn in range(3):  # replay: model ids, then the observation's ids
            want_prefixes.append(list(seq))
            ids, _ = sample(seq, c.sample_index if turn == 0 else 0, 8, 4)
            seq += ids
            mask += [True] * len(ids)
            lps += [-0.01 * (t + 1) for t in ids]
            if turn < 2:
                obs = [VOCAB + turn, VOCAB + c.prompt_index]
                seq += obs
                mask += [False] * 2
                lps += [0.0, 0.0]
        assert prompts[c.prompt_index] + c.token_ids == seq
        assert c.loss_mask == mask and c.logprobs == lps
        assert c.turns == 3 and c.truncation == "" and c.finish_reason == "stop"
        assert c.text == " ".join(map(str, c.token_ids[-4:]))  # the last turn's
        assert (c.tool_calls, c.tool_errors, c.tool_seconds) == (2, 1, 0.5)
        assert c.turn_rewards == [0.5, 0.5, 1.0]  # joined by megagrpo.reward.environment
        # later turns continued from the exact token prefix
        k = c.prompt_index * 2 + c.sample_index
        assert eng.calls[1][0][k] == want_prefixes[1] and eng.calls[2][0][k] == want_prefixes[2]
    m = agent_metrics(comps)
    assert m["turns"] == 3 and m["tool_calls"] == 2 and m["env_token_share"] == 4 / 16


class StripsStop(FakeEngine):
    """Like vLLM with a stop string: the text drops the matched stop, the ids keep it."""

    def generate(self, prompts, sampling):
        out = super().generate(prompts, sampling)
        for c in out:
            c.text = " ".join(map(str, c.token_ids[:-1]))
        return out


class Seen(Environment):
    texts: list[str] = []

    def step(self, turn: Turn) -> Observation:
        Seen.texts.append(turn.text)
        return Observation(done=True)


def test_turn_text_is_the_text_of_the_sampled_ids():
    """The environment parses the text of exactly the sampled ids (a tool call's closing tag
    that vLLM matched as a stop string is in it), not the engine's own text."""
    Seen.texts = []
    cfg = AgentConfig(environment="x:y")
    runner = TrajectoryRunner(engine=StripsStop(4), tokenizer=Tok(), agent=cfg,
                              max_model_len=64, factory=lambda rec: Seen(rec, Tok()))
    comps = runner.run([[1, 2, 3]], [{"k": 0}], SamplingSettings(max_tokens=8, n=2))
    assert Seen.texts == [Tok().decode(c.token_ids) for c in comps]
    assert [c.text for c in comps] == Seen.texts


def test_truncation_causes():
    c, _, _ = run(Counter, length=9)  # every first turn runs past max_tokens=8
    assert {x.truncation for x in c} == {"turn_length"} and all(x.turns == 1 for x in c)
    assert all(x.finish_reason == "length" and len(x.token_ids) == 8 for x in c)
    c, _, _ = run(Endless, max_turns=2, env_reward="last")
    for x in c:  # the last observation is not appended
        assert x.truncation == "max_turns" and x.turns == 2 and len(x.token_ids) == 4 + 3 + 4
        assert x.loss_mask == [True] * 4 + [False] * 3 + [True] * 4 and x.turn_rewards == [0.0, 1.0]
    c, eng, _ = run(Endless, max_total_tokens=13, max_turns=4)
    # turn 1: 4 + obs 3, turn 2: 4 (11 used), the observation would reach 14 > 13: stop
    assert all(x.truncation == "token_budget" and len(x.token_ids) == 11 for x in c)
    c, eng, _ = run(Endless, max_total_tokens=9, max_turns=4)
    # turn 2 asks for at most 9 - 7 = 2 tokens and is cut there
    assert eng.calls[1][1].max_tokens == 2
    assert all(x.truncation == "token_budget" and len(x.token_ids) == 9 for x in c)
    assert all(x.finish_reason == "length" for x in c)


def test_raising_environment_ends_its_trajectory_only(caplog):
    with caplog.at_level(logging.WARNING, logger="megagrpo"):
        comps, _, runner = run(Raising)
    bad = [c for c in comps if c.prompt_index == 1]
    assert all(c.truncation == "env_error" and c.turns == 2 for c in bad)
    assert all(c.truncation == "" and c.turns == 3 for c in comps if c.prompt_index == 0)
    assert sum("tool server down" in r.message for r in caplog.records) == 1  # reported once
    assert runner.reported


def test_env_tokens_masked_in_batch():
    comps, _, _ = run(Counter)
    prompts = [[1, 2, 3], [4, 5]]
    b = pack([prompts[c.prompt_index] for c in comps], [c.token_ids for c in comps],
             [c.logprobs for c in comps], torch.ones(4), pad_id=0,
             loss_masks=[c.loss_mask for c in comps])
    for r, c in enumerate(comps):
        L = len(prompts[c.prompt_index])
        want = torch.zeros(b.ids.shape[1], dtype=torch.bool)
        want[L - 1:L - 1 + len(c.token_ids)] = torch.tensor(c.loss_mask)
        assert torch.equal(b.mask[r], want)
        assert torch.equal(b.target[r][b.mask[r]],
                           torch.tensor([t for t, m in zip(c.token_ids, c.loss_mask) if m]))
        assert (b.rollout_logp[r][~b.mask[r]] == 0).all()
        assert (b.advantages[r][~b.mask[r]] == 0).all()


def test_environment_class_errors():
    with pytest.raises(ValueError, match="agent.environment='no_such_mod:Env'"):
        environment_class("no_such_mod:Env")
    with pytest.raises(ValueError, match="not a subclass"):
        environment_class("megagrpo.agent.env:Turn")
    with pytest.raises(ValueError, match="agent.environment=tools"):
        environment_class("tools")
    assert environment_class("tests.test_agent_runner:Counter") is Counter
