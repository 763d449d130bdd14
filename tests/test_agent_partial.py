"""Multi-turn partial rollouts without vLLM (megagrpo.agent.runner.TrajectoryRunner.advance):
a fake engine with the real engine's pause contract (`run_partial`: one token per decode step,
the pause checked before each step, the cap read through `oldest`) and a token rule that
depends on the exact prefix only, so a trajectory paused and continued must come out with the
ids of the same trajectory run without a pause (`TrajectoryRunner.run`, the reference). Each
token's log-prob carries the version that sampled it (-0.01 (id + 1) - version), so the stamps
are checked token by token. The real engine: tests/test_partial_rollout.py; in the trainer:
tests/_partial_check.py:agent_partial_check.
"""
from __future__ import annotations

import json
import logging

import torch

from megagrpo.agent import Environment, Observation, Turn
from megagrpo.agent.runner import TrajectoryRunner, spans
from megagrpo.checkpoint import load_tree, save_tree
from megagrpo.config.agent import AgentConfig
from megagrpo.config.layout import RolloutLayout
from megagrpo.data import Example, PromptLoader, encode_prompt
from megagrpo.engine import Completion, SamplingSettings
from megagrpo.engine.partial import PartialResult
from megagrpo.engine.types import NO_VERSION
from megagrpo.reward import Rewards
from megagrpo.rollout.collect import RolloutCollector
from tests.test_stream import Reward, Tok, _config

VOCAB, G, MAX_TOKENS = 50, 2, 6
PROMPTS = [[1, 2, 3], [4, 5], [7, 8, 9, 10]]


def next_id(prefix: list[int], j: int) -> int:
    return (sum((i + 1) * t for i, t in enumerate(prefix)) * 31 + 7 * j) % VOCAB


def ends_turn(tok: int) -> bool:
    return tok % 4 == 0


class Engine:
    """`generate` (the reference runner's) and `generate_partial` (the partial runner's) by
    one rule: the next id from the prefix (the sample index on the first turn only)."""

    def __init__(self, prompts):
        self.firsts = {tuple(p) for p in prompts}
        self.steps = 0

    def _one(self, prefix: list[int], done: list[int], j: int, version: int) -> tuple[int, float]:
        first = tuple(prefix) in self.firsts
        tok = next_id(prefix + done, j if first else 0)
        return tok, -0.01 * (tok + 1) - version

    def generate(self, prompts, sampling):
        out = []
        for i, p in enumerate(prompts):
            for j in range(sampling.n):
                ids, lps = [], []
                while len(ids) < sampling.max_tokens:
                    tok, lp = self._one(list(p), ids, j, 0)
                    ids.append(tok)
                    lps.append(lp)
                    if ends_turn(tok):
                        break
                out.append(Completion(prompt_index=i, sample_index=j, token_ids=ids,
                                      logprobs=lps, finish_reason="stop" if ends_turn(ids[-1])
                                      else "length"))
        return out

    def generate_partial(self, prompts, trajs, sampling, *, version, pause=None,
                         max_updates=0, limits=None, oldest=None) -> PartialResult:
        limits = limits or [sampling.max_tokens] * len(trajs)
        live = dict(zip(map(id, trajs), limits))
        held = []
        if pause is not None and pause.is_set():
            held = [t for t in trajs if version - oldest(t, version) < max_updates]
        live = {k: v for k, v in live.items() if all(k != id(h) for h in held)}
        stopped = pause is not None and pause.is_set()
        while live:
            if pause is not None and not stopped and pause.is_set():
                stopped = True
                now = [t for t in trajs if id(t) in live
                       and version - oldest(t, version) < max_updates]
                held += now
                live = {k: v for k, v in live.items() if all(k != id(h) for h in now)}
                continue
            for t in trajs:
                if id(t) not in live:
                    continue
                tok, lp = self._one(list(prompts[t.prompt_index]), t.token_ids,
                                    t.sample_index, version)
                t.token_ids.append(tok)
                t.logprobs.append(lp)
                t.token_versions.append(version)
                if ends_turn(tok) or len(t.token_ids) == live[id(t)]:
                    t.finish_reason = "stop" if ends_turn(tok) else "length"
                    del live[id(t)]
            self.steps += 1
        return PartialResult([t for t in trajs if t.finish_reason],
                             [t for t in trajs if not t.finish_reason], 0, 0)


class Answers(Environment):
    """Answers turns 1 and 2 with (40 + turn, 45), done after turn 3; every step is logged."""

    log: list = []

    def step(self, turn: Turn) -> Observation:
        Answers.log.append((self.record["k"], tuple(turn.token_ids)))
        if turn.index >= 2:
            return Observation(done=True, reward=1.0)
        return Observation(token_ids=(40 + turn.index, 45), reward=0.5)


class Pause:
    """The pause signal, set from the engine's `at`-th decode step of the call on."""

    def __init__(self, engine: Engine, at: int):
        self.engine, self.at = engine, at

    def is_set(self) -> bool:
        return self.engine.steps >= self.at


def _runner(engine, env: type = None) -> TrajectoryRunner:
    return TrajectoryRunner(engine=engine, tokenizer=Tok(), max_model_len=64,
                            agent=AgentConfig(environment="x:y", max_turns=3),
                            factory=lambda rec: (env or Answers)(rec))


RECORDS = [{"k": i} for i in range(len(PROMPTS))]
S = SamplingSettings(max_tokens=MAX_TOKENS, n=G)


def _reference() -> list[Completion]:
    Answers.log = []
    return _runner(Engine(PROMPTS)).run(PROMPTS, RECORDS, S)


def _by_key(comps):
    return {(c.prompt_index, c.sample_index): c for c in comps}


def _paused_run(stops: list[tuple[int, int]]) -> tuple[list, list]:
    """Every trajectory started at version 0, then one `advance` per (pause step, cap), at
    versions 0, 1, ...; the last continues without a pause. Returns (completions in the
    order they ended, the trajectories held after each call)."""
    eng = Engine(PROMPTS)
    runner = _runner(eng)
    Answers.log = []
    trajs = runner.start(PROMPTS, list(range(len(PROMPTS))), G)
    done, held = [], []
    for version, (at, cap) in enumerate(stops):
        eng.steps = 0
        res = runner.advance(trajs, RECORDS, S, version=version, pause=Pause(eng, at),
                             max_updates=cap)
        done += res.finished
        held.append([(t.prompt_index, t.sample_index, t.turn is not None) for t in res.paused])
        trajs = res.paused
    res = runner.advance(trajs, RECORDS, S, version=len(stops))
    return done + res.finished, held


def test_paused_and_continued_trajectories_are_the_unpaused_ones_stamped_per_token():
    """Paused after 2 decode steps at version 0 (cap 2): some trajectories are held in the
    middle of a turn, some between turns; continued at version 1. Ids, mask, turns, rewards and
    every environment step are those of the run without a pause; each model token is stamped
    with the version that sampled it (its log-prob says which), each environment token
    NO_VERSION with log-prob 0."""
    ref = _by_key(_reference())
    ref_log = sorted(Answers.log)
    got, held = _paused_run([(2, 2)])
    assert {m for *_, m in held[0]} == {True, False}, held  # mid-turn and between turns
    assert sorted(Answers.log) == ref_log  # every environment step once, none asked again
    got = _by_key(got)
    assert got.keys() == ref.keys()
    mid = between = 0
    for key, c in got.items():
        r = ref[key]
        assert (c.token_ids, c.loss_mask, c.turns, c.turn_rewards, c.truncation) == \
            (r.token_ids, r.loss_mask, r.turns, r.turn_rewards, r.truncation), key
        for tok, lp, v, m in zip(c.token_ids, c.logprobs, c.token_versions, c.loss_mask):
            if m:
                assert v in (0, 1) and abs(lp - (-0.01 * (tok + 1) - v)) < 1e-12
            else:
                assert v == NO_VERSION and lp == 0.0
        m, b = spans(c)
        mid, between = mid + (m > 0), between + (b > 0)
    assert mid > 0 and between > 0


def test_the_cap_finishes_a_trajectory_on_the_weights_it_has():
    """Paused at version 0, then at version 1 with rollout.partial_max_updates = 1: every
    trajectory is one update old, so none is held again; each runs its remaining turns to the
    end under version 1 (no token of version 2). With a cap of 2 some are held again."""
    got, held = _paused_run([(2, 2), (1, 1)])
    assert held[0] and held[1] == [], held
    assert all(set(v for v in c.token_versions if v != NO_VERSION) <= {0, 1} for c in got)
    got2, held2 = _paused_run([(2, 2), (1, 2)])
    assert held2[1], held2
    assert any(2 in c.token_versions for c in got2)
    ref = _by_key(_reference())
    for c in got + got2:
        assert c.token_ids == ref[(c.prompt_index, c.sample_index)].token_ids


DATA = [Example(prompt=str(i), answer="x", record={"k": i % 3}) for i in range(6)]


def _collector(env: type = None) -> tuple[RolloutCollector, Engine]:
    cfg = _config(1, partial_rollouts=True, max_tokens=MAX_TOKENS)
    cfg.agent.environment, cfg.agent.max_turns = "x:y", 3
    eng = Engine([])
    c = RolloutCollector(cfg=cfg, engine=eng, tokenizer=Tok(), rewards=Rewards(Reward()),
                         loader=PromptLoader(DATA, 3, seed=1), runner=_runner(eng, env),
                         layout=RolloutLayout(rank=0, world_size=1, engine_tp=1,
                                              train_tp=1, train_pp=1))
    eng.firsts = {tuple(encode_prompt(Tok(), e.prompt)) for e in DATA}
    return c, eng


def test_a_resume_restarts_paused_trajectories_from_their_prompt(caplog):
    """A batch paused mid-draw saved in the collector's state (through JSON) and loaded by a
    fresh collector: its paused trajectories start again from their prompt (said once on the
    console, counted as partial_restarted); continued, every trajectory of the batch is whole
    and equal to the run without a pause."""
    collector = _collector
    c, eng = collector()
    drawn = c.draw(0, Pause(eng, 2))
    lost = sum(bool(t.ids or (t.turn and t.turn.token_ids)) for t in drawn.unfinished)
    assert drawn.unfinished and lost
    c.queue = [drawn]
    state = json.loads(json.dumps(c.state_dict()))
    c2, _ = collector()
    with caplog.at_level(logging.WARNING, logger="megagrpo"):
        c2.load_state_dict(state)
    said = [r.getMessage() for r in caplog.records if "start again" in r.getMessage()]
    assert len(said) == 1 and f"resumed with {lost} multi-turn" in said[0], said
    back = c2.queue[0]
    assert back.metrics["partial_restarted"] == lost
    assert all(not t.ids and t.turn is None and not t.started for t in back.unfinished)
    c2.advance(back, 1)
    assert not back.unfinished
    whole = _by_key(back.completions)
    assert sorted(whole) == [(p, j) for p in range(3) for j in range(G)]
    for c in back.completions:  # the ids the unpaused runner gives
        Answers.log = []
        ref = _runner(Engine([back.prompts[c.prompt_index]])).run(
            [back.prompts[c.prompt_index]], [back.records[c.prompt_index]], S)
        assert c.token_ids == ref[c.sample_index].token_ids


class Remembers(Answers):
    """Answers whose observation depends on what it remembers, not on the turn it is shown:
    the sum of every id of the turns it answered (a tensor) and how many, so an environment
    built afresh at a resume without its state answers otherwise. Its state is saved for
    records k != 0; k = 0's state_dict gives None (cannot save: restarted)."""

    def __init__(self, record, tokenizer=None, **kwargs):
        super().__init__(record, tokenizer)
        self.total, self.answered = torch.zeros(1, dtype=torch.int64), 0

    def step(self, turn: Turn) -> Observation:
        Answers.log.append((self.record["k"], tuple(turn.token_ids)))
        self.total += sum(turn.token_ids)
        self.answered += 1
        if turn.index >= 2:
            return Observation(done=True, reward=1.0)
        return Observation(token_ids=(40 + int(self.total) % 7, 45 + self.answered),
                           reward=0.5)

    def state_dict(self):
        if self.record["k"] == 0:
            return None
        return {"total": self.total.clone(), "answered": self.answered}

    def load_state_dict(self, state):
        self.total, self.answered = state["total"].clone(), state["answered"]


def _saved_and_loaded(c: RolloutCollector, tmp_path, env: type = Remembers):
    """`c`'s state written and read as a checkpoint holds it (save_tree: safetensors, no
    pickle) and loaded by a fresh collector."""
    save_tree(tmp_path / "rollout.safetensors", c.state_dict())
    c2, _ = _collector(env)
    c2.load_state_dict(load_tree(tmp_path / "rollout.safetensors"))
    return c2


def test_a_resume_continues_trajectories_whose_environment_saves_its_state(tmp_path, caplog):
    """Paused mid-draw at version 0, saved in a checkpoint and loaded by a fresh collector:
    the trajectories whose environment saves its state (records k != 0) go on where they were
    (their ids and version-0 stamps kept, the turn in progress continued, the environment
    never asked a turn twice); k = 0's start again from the prompt, counted and said. Every
    trajectory ends equal to the unpaused run's, turn rewards included."""
    Answers.log = []
    c, eng = _collector(Remembers)
    drawn = c.draw(0, Pause(eng, 5))
    before = {(t.prompt_index, t.sample_index): (list(t.ids), t.turn is not None)
              for t in drawn.unfinished}
    keeps = {key for key in before if drawn.records[key[0]]["k"] != 0}
    assert {before[key][1] for key in keeps} == {True, False}, before  # mid-turn, between
    lost = sum(bool(ids or mid) for key, (ids, mid) in before.items() if key not in keeps)
    c.queue = [drawn]
    with caplog.at_level(logging.INFO, logger="megagrpo"):
        c2 = _saved_and_loaded(c, tmp_path)
    said = [r.getMessage() for r in caplog.records]
    assert any(f"resumed with {len(keeps)} multi-turn trajectories paused at a weight update, "
               "continued where paused" in m for m in said), said
    assert any(f"resumed with {lost} multi-turn" in m and "start again" in m for m in said) \
        == bool(lost), said
    back = c2.queue[0]
    assert back.metrics["partial_restarted"] == lost
    for t in back.unfinished:
        key = (t.prompt_index, t.sample_index)
        assert t.ids == (before[key][0] if key in keeps else []), key
        assert t.started == (key in keeps) and (t.env is not None) == (key in keeps)
    steps = list(Answers.log)  # the environments' steps before the pause
    Answers.log = []
    c2.advance(back, 1)
    steps += Answers.log
    assert not back.unfinished
    got = _by_key(back.completions)
    assert sorted(got) == [(p, j) for p in range(3) for j in range(G)]
    for (p, j), comp in got.items():  # the unpaused runner's trajectory, token for token
        ref = _runner(Engine([back.prompts[p]]), Remembers).run(
            [back.prompts[p]], [back.records[p]], S)[j]
        assert (comp.token_ids, comp.loss_mask, comp.turn_rewards) == \
            (ref.token_ids, ref.loss_mask, ref.turn_rewards), (p, j)
        model = [v for v, m in zip(comp.token_versions, comp.loss_mask) if m]
        if (p, j) in keeps:  # what it sampled before the pause keeps version 0
            n0 = sum(comp.loss_mask[:len(before[(p, j)][0])]) + (before[(p, j)][1] or 0)
            assert model[:n0] == [0] * n0 and 0 in model, (p, j, model)
        else:
            assert set(model) == {1}, (p, j, model)
    # the environments of kept trajectories answered each turn once over the two runs
    Answers.log = []
    for p in range(len(back.prompts)):
        _runner(Engine([back.prompts[p]]), Remembers).run([back.prompts[p]],
                                                          [back.records[p]], S)
    kept = {back.records[p]["k"] for p, _ in keeps}
    assert sorted(x for x in steps if x[0] in kept) == \
        sorted(x for x in Answers.log if x[0] in kept)


def test_an_environment_that_cannot_give_or_take_its_state_restarts_or_fails_contained(
        tmp_path, caplog):
    """state_dict giving what a checkpoint cannot hold (a set): reported once, the
    trajectories saved as their prompt and restarted (counted). load_state_dict raising at the
    resume: each such trajectory ends as an environment error (dropped, agent.on_env_error),
    the others of the batch run on."""

    class Unsaveable(Remembers):
        def state_dict(self):
            return {"seen": {1, 2}}

    class Unloadable(Remembers):
        def load_state_dict(self, state):
            raise RuntimeError("planted: cannot restore")

    for env in (Unsaveable, Unloadable):
        caplog.clear()
        c, eng = _collector(env)
        drawn = c.draw(0, Pause(eng, 2))
        c.queue = [drawn]
        with caplog.at_level(logging.WARNING, logger="megagrpo"):
            c2 = _saved_and_loaded(c, tmp_path, env)
            back = c2.queue[0]
            c2.advance(back, 1)
        said = [r.getMessage() for r in caplog.records]
        got = back.completions
        assert sorted((x.prompt_index, x.sample_index) for x in got) == \
            [(p, j) for p in range(3) for j in range(G)]
        if env is Unsaveable:
            assert sum("state_dict failed" in m and "TypeError" in m and "is a set" in m
                       for m in said) == 1, said
            assert back.metrics["partial_restarted"] > 0
            assert not any(x.dropped for x in got)
        else:
            failed = [x for x in got if x.truncation == "env_error"]
            assert failed and all(x.dropped == "env_error" for x in failed)
            assert {back.records[x.prompt_index]["k"] for x in failed} <= {1, 2}
            assert any("restoring" in m and "planted: cannot restore" in m for m in said), said
            assert any(not x.dropped for x in got)
