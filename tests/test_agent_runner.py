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


class Flaky(Environment):
    """Fails the first `fails` calls of its step (raise, NaN reward, a non-Observation, or a
    hang of 2 s), then answers like Counter; `calls` counts every call on the class."""

    calls = 0
    fails = 1
    how = "raise"

    def step(self, turn: Turn) -> Observation:
        type(self).calls += 1
        if type(self).calls <= type(self).fails:
            if self.how == "raise":
                raise RuntimeError("flaky tool server")
            if self.how == "nan":
                return Observation(text="x", reward=float("nan"))
            if self.how == "none":
                return None
            if self.how == "hang":
                import time

                time.sleep(2.0)
        return Counter.step(self, turn)


def _flaky(how: str, fails: int):
    return type(f"Flaky_{how}_{fails}", (Flaky,), {"calls": 0, "fails": fails, "how": how})


@pytest.mark.parametrize("how", ["raise", "nan", "none"])
def test_a_failing_step_is_asked_again(how):
    """A step that raises or answers with garbage is asked again with the same turn: one
    failure within agent.env_retries leaves the trajectory exactly as a clean run's."""
    env = _flaky(how, 1)
    comps, _, _ = run(env, G=1, prompts=((1, 2, 3),), env_retries=2)
    clean, _, _ = run(Counter, G=1, prompts=((1, 2, 3),))
    (c,), (want,) = comps, clean
    assert (c.token_ids, c.loss_mask, c.turn_rewards) == (want.token_ids, want.loss_mask,
                                                          want.turn_rewards)
    assert c.truncation == "" and c.dropped == "" and c.env_retries == 1
    assert env.calls == 3 + 1  # three turns, one asked twice


@pytest.mark.parametrize("how", ["raise", "nan"])
def test_a_step_failing_every_try_drops_the_trajectory(how, caplog):
    env = _flaky(how, 10 ** 6)
    with caplog.at_level(logging.WARNING, logger="megagrpo"):
        comps, _, _ = run(env, G=2, prompts=((1, 2, 3),), env_retries=2)
    assert env.calls == 2 * 3  # each trajectory: 1 + env_retries tries of its first step
    assert all(c.truncation == "env_error" and c.dropped == "env_error" and c.turns == 1
               and c.env_retries == 2 for c in comps)
    assert sum("after 3 tries" in r.message and "dropped from training" in r.message
               for r in caplog.records) == 1
    kept, _, _ = run(_flaky(how, 10 ** 6), G=2, prompts=((1, 2, 3),), env_retries=0,
                     on_env_error="keep")
    assert all(c.truncation == "env_error" and c.dropped == "" for c in kept)


def test_a_hanging_step_fails_at_the_deadline_without_a_retry():
    import time

    env = _flaky("hang", 1)
    t0 = time.perf_counter()
    comps, _, _ = run(env, G=1, prompts=((1, 2, 3),), env_retries=3, env_timeout_s=0.2)
    assert time.perf_counter() - t0 < 1.5  # not the 2 s the step sleeps
    (c,) = comps
    assert c.dropped == "env_error" and c.env_retries == 0 and env.calls == 1


def test_a_close_that_raises_keeps_the_finished_trajectory():
    class BadClose(Counter):
        def close(self):
            raise OSError("socket gone")

    comps, _, _ = run(BadClose)
    assert all(c.truncation == "" and c.dropped == "" and c.turns == 3 for c in comps)


def test_dropped_samples_leave_the_groups_and_the_loss():
    """build_batch on a rollout with dropped trajectories: they have no loss token and
    advantage 0, and the others' advantages are those of groups drawn without them."""
    from megagrpo.config.train import TrainConfig
    from megagrpo.rollout.stream import Rollout
    from megagrpo.train.advantage import advantages, build_batch

    G = 4
    cfg = TrainConfig()
    cfg.algo.group_size = G
    prompts = [[1, 2, 3], [4, 5]]
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 1.0, 0.25])
    drop = [False, True, False, False, False, False, False, True]
    comps = [Completion(prompt_index=i // G, sample_index=i % G, token_ids=[7, 8, 9],
                        logprobs=[-0.1] * 3, finish_reason="stop", text="",
                        dropped="env_error" if d else "") for i, d in enumerate(drop)]
    ro = Rollout(prompts=prompts, answers=["", ""], completions=comps, rewards=rewards)
    batch, shaped = build_batch(ro, cfg, pad_id=0, multiple=1)
    adv = advantages(shaped.rewards, cfg.algo, valid=shaped.valid)
    keep = ~torch.tensor(drop)
    # the reference: each group without its dropped sample (3 of 4), the plain GRPO formula
    want = torch.zeros(8)
    want[keep] = torch.cat([(g - g.mean()) / (g.std() + cfg.algo.std_eps)
                            for g in rewards[keep].view(2, 3)])
    assert torch.allclose(adv, want, atol=1e-6)
    assert shaped.metrics["dropped_frac"] == 2 / 8
    real = batch.real(batch.mask)
    assert not real[~keep].any() and real[keep].any(dim=1).all()


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


class CharTok(Tok):
    """Characters of an environment's text as ids (tests/_agent_env.py answers '0=7 ')."""

    def encode(self, text):
        return [VOCAB + ord(ch) % 16 for ch in text]


def test_an_environment_raising_in_10pct_of_turns_and_hanging_in_1pct():
    """Issue 47's flaky environment (tests/_agent_env.py:Flaky, the fault harness's: a turn
    raises on every try with probability 10% and hangs past agent.env_timeout_s with 1%,
    fixed by the prompt's record and the turn) over 300 prompts x G=2: every trajectory that
    met a fault, and only those, is dropped (the reference replays the faults from the record
    by hand); the batch built from them counts them in `dropped_frac`, gives them no loss token
    and leaves them out of their groups' advantages, so no zero (or partial) reward of theirs
    is trained; the rest are the full three turns."""
    import time

    from megagrpo.config.train import TrainConfig
    from megagrpo.rollout.stream import Rollout
    from megagrpo.train.advantage import advantages, build_batch
    from tests._agent_env import Flaky as Flaky10
    from tests._agent_env import _fault_roll

    class Quick(Flaky10):
        HANG_S = 0.3  # past the deadline below, short enough for the suite

    G, n = 2, 300
    records = [{"a": i, "b": 7 * i} for i in range(n)]
    eng = FakeEngine(4)
    runner = TrajectoryRunner(engine=eng, tokenizer=CharTok(), max_model_len=128,
                              agent=AgentConfig(environment="x:y", max_turns=3, env_retries=2,
                                                env_timeout_s=0.1),
                              factory=lambda rec: Quick(rec, CharTok()))
    t0 = time.perf_counter()
    comps = runner.run([[1 + i % 7, 2] for i in range(n)], records,
                       SamplingSettings(max_tokens=8, n=G))
    took = time.perf_counter() - t0
    rolls = [[_fault_roll(r, t) for t in range(3)] for r in records]
    faulty = [any(x < 11 for x in rs) for rs in rolls]
    hangs = sum(x < 1 for rs in rolls for x in rs)
    assert hangs >= 1 and 0.05 < sum(x < 11 for rs in rolls for x in rs) / (3 * n) < 0.15
    for c in comps:
        assert (c.dropped == "env_error") == faulty[c.prompt_index], c
        assert c.dropped or (c.turns == 3 and c.truncation == "")
    assert took < 30, took  # hangs cut at the deadline, not waited out
    rewards = torch.tensor([sum(c.turn_rewards) if not c.dropped else 0.0 for c in comps])
    ro = Rollout(prompts=[[1 + i % 7, 2] for i in range(n)], answers=[""] * n,
                 completions=comps, rewards=rewards)
    cfg = TrainConfig()
    cfg.algo.group_size = G
    batch, shaped = build_batch(ro, cfg, pad_id=0, multiple=1)
    dropped = torch.tensor([bool(c.dropped) for c in comps])
    assert shaped.metrics["dropped_frac"] == pytest.approx(sum(faulty) / n, rel=1e-6)
    assert not shaped.valid[dropped].any() and shaped.valid[~dropped].all()
    real = batch.real(batch.mask)
    assert not real[dropped].any() and real[~dropped].any(dim=1).all()
    adv = advantages(shaped.rewards, cfg.algo, valid=shaped.valid)
    assert (adv[dropped] == 0).all()  # and the kept ones: groups without the dropped
    kept_groups = [g for g in range(n) if not faulty[g]]
    assert torch.equal(adv.view(n, G)[kept_groups], advantages(
        rewards.view(n, G)[kept_groups].reshape(-1), cfg.algo).view(-1, G))
