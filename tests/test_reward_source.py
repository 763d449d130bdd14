"""The reward seam (megagrpo.reward): the `rules` source gives today's numbers, sources see whole
samples, a source may answer with a future the collector awaits at gather, deadlines still
hold, the environment's per-turn rewards join through the seam, and a second source registered
here is selected by config alone (fake engine, no vLLM, no torchrun)."""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest
import torch

from megagrpo.config.data import RewardConfig, RewardTermConfig
from megagrpo.config.layout import RolloutLayout
from megagrpo.config.train import TrainConfig
from megagrpo.data import Example, PromptLoader
from megagrpo.reward import (
    Rewards,
    RuleTerms,
    Sample,
    Scores,
    build_rewards,
    check_source,
    exact_match_reward,
    format_reward,
    register_source,
    resolve_reward,
)
from megagrpo.rollout.collect import RolloutCollector
from megagrpo.tasks.arithmetic import reward as arithmetic_reward
from tests.test_agent_collector import Tok
from tests.test_agent_runner import FakeEngine


def text(c) -> str:
    """What the collector scores: the completion's text, decoded when the engine gave none."""
    return c.text or Tok().decode(c.token_ids)


def sample(completion: str, answer: str, **kw) -> Sample:
    return Sample(prompt="q", prompt_ids=[1], completion=completion, completion_ids=[2],
                  answer=answer, **kw)


def test_rules_source_gives_the_rule_functions_numbers():
    """Weighted total, unweighted per-term values, `correct` from the marked term, per-term
    metrics: what the rule functions give, summed in the configured order in float32."""
    terms = [RewardTermConfig(name="exact_match", weight=0.3),
             RewardTermConfig(name="format", weight=-0.7, kwargs={"pattern": r"\d+"}),
             RewardTermConfig(name="arithmetic", weight=1.1, correctness=True)]
    texts, answers = ["19", "ab", " 7.", "20"], ["19", "ab", "7", "19"]
    scores = build_rewards(RewardConfig(terms=terms)).score(
        [sample(t, a) for t, a in zip(texts, answers)])
    em = [exact_match_reward(t, a) for t, a in zip(texts, answers)]
    fm = [format_reward(t, a, pattern=r"\d+") for t, a in zip(texts, answers)]
    ar = [arithmetic_reward(t, a) for t, a in zip(texts, answers)]
    assert (em, fm, ar) == ([1, 1, 1, 0], [1, 0, 0, 1], [1, 1, 0, 0])  # by hand
    want = torch.zeros(4, dtype=torch.float32)
    for w, v in ((0.3, em), (-0.7, fm), (1.1, ar)):
        want += w * torch.tensor(v, dtype=torch.float32)
    assert scores.rewards.dtype == torch.float32 and torch.equal(scores.rewards, want)
    assert scores.per_term["format"].tolist() == fm
    assert scores.per_term["exact_match"].tolist() == em
    assert scores.correct.tolist() == [True, True, False, False]  # arithmetic, not the total
    assert scores.metrics["reward/exact_match"] == pytest.approx(0.75)
    assert scores.metrics["reward_errors"] == 0 and scores.metrics["reward_timeouts"] == 0


def test_old_dotted_names_still_resolve():
    assert resolve_reward("megagrpo.rewards:math_reward") is resolve_reward("math")
    assert resolve_reward("megagrpo.rewards:exact_match_reward") is exact_match_reward


def sleepy(completion: str, answer: str) -> float:
    time.sleep(0.6)
    return 1.0


def test_deadline_holds_through_the_seam():
    cfg = RewardConfig(terms=[{"name": "exact_match"},
                              {"name": "tests.test_reward_source:sleepy"}], timeout_s=0.1)
    scores = build_rewards(cfg).score([sample("a", "a")])
    assert scores.rewards.tolist() == [1.0]  # the sleeper timed out: 0, counted
    assert scores.metrics["reward_timeouts"] == 1
    time.sleep(0.6)  # let the abandoned call finish before other tests count threads


class Recording:
    """A reward source that keeps what it was given; the score is the completion's length."""

    def __init__(self) -> None:
        self.batches: list[list[Sample]] = []

    def score(self, samples):
        self.batches.append(samples)
        r = torch.tensor([float(len(s.completion)) for s in samples])
        return Scores(rewards=r, per_term={"len": r}, correct=r > 5)

    def close(self):
        pass


class Later(Recording):
    """Answers with a future that the test resolves."""

    def __init__(self) -> None:
        super().__init__()
        self.futures: list[tuple[Future, Scores]] = []

    def score(self, samples):
        fut: Future = Future()
        self.futures.append((fut, super().score(samples)))
        return fut


def collector(rewards: Rewards, environment: str = "", env_reward: str = "sum"
              ) -> RolloutCollector:
    cfg = TrainConfig()
    cfg.agent.environment, cfg.agent.env_reward = environment, env_reward
    cfg.algo.group_size, cfg.rollout.max_tokens = 2, 8
    data = [Example(prompt=f"p{i}", answer=f"a{i}", record={"k": i}) for i in range(4)]
    return RolloutCollector(cfg=cfg, engine=FakeEngine(), loader=PromptLoader(data, 4, seed=1),
                            tokenizer=Tok(), rewards=rewards,
                            layout=RolloutLayout(rank=0, world_size=1, engine_tp=1, train_tp=1,
                                                 train_pp=1))


def test_source_gets_whole_samples_in_one_batch():
    src = Recording()
    c = collector(Rewards(src))
    ro = c.next(version=0)
    assert len(src.batches) == 1 and len(src.batches[0]) == 8  # one call for the batch
    for s, comp in zip(src.batches[0], ro.completions, strict=True):
        i = int(s.prompt[1:])
        assert s.prompt == f"p{i}" and s.prompt_ids == Tok().encode(f"p{i}")
        assert s.answer == f"a{i}" and s.record == {"k": i}
        assert s.completion == text(comp) and s.completion_ids == comp.token_ids
        assert s.turn_rewards is None
    assert ro.rewards.tolist() == [float(len(text(x))) for x in ro.completions]


def test_a_future_is_awaited_when_the_batch_is_gathered():
    src = Later()
    c = collector(Rewards(src))
    drawn = c.draw(version=0)  # sampled and submitted; the scores are not there yet
    (fut, scores), = src.futures
    assert not fut.done() and drawn.pending is not None and drawn.rewards == []
    fut.set_result(scores)  # e.g. a reward model finishing while the next batch samples
    ro = c.gather(drawn)
    assert len(ro.completions) == 8 and drawn.pending is None
    assert ro.rewards.tolist() == [float(len(text(x))) for x in ro.completions]
    assert [x.correct for x in ro.completions] == [len(text(x)) > 5 for x in ro.completions]
    assert ro.metrics["reward_failed"] == 0
    assert ro.metrics["reward_overlap_s"] > 0  # scored between the draw and the gather


def test_the_reward_phase_says_what_it_blocked_overlapped_and_waited_for():
    """A synchronous source blocks the sampling thread and overlaps nothing; a future that
    completes only after the gather began overlapped everything up to the gather and kept it
    waiting."""
    ro = collector(Rewards(Recording())).next(version=0)
    assert ro.metrics["reward_overlap_s"] == 0 and ro.metrics["reward_blocking_s"] > 0
    src = Later()
    c = collector(Rewards(src))
    drawn = c.draw(version=0)
    (fut, scores), = src.futures
    timer = threading.Timer(0.05, fut.set_result, args=(scores,))
    timer.start()  # completes while the gather below waits
    ro = c.gather(drawn)
    timer.join()
    assert ro.metrics["reward_wait_s"] > 0 and ro.metrics["reward_overlap_s"] > 0
    assert len(ro.completions) == 8


def test_environment_rewards_join_through_the_seam():
    """Multi-turn with the Counter environment (turn rewards 0.5, 0.5, 1.0): the total is the
    rules' plus the joined environment reward, as agent.env_reward says."""
    cfg = RewardConfig(terms=[{"name": "format", "kwargs": {"pattern": r".*5[0-9].*"}}])
    env = "tests.test_agent_runner:Counter"
    for mode, joined in (("sum", 2.0), ("last", 1.0), ("none", 0.0)):
        c = collector(build_rewards(cfg, mode), environment=env, env_reward=mode)
        ro = c.next(version=0)
        rules = RuleTerms(cfg).score_texts([text(x) for x in ro.completions],
                                           [ro.answers[x.prompt_index] for x in ro.completions])
        want = rules[0] + torch.tensor([joined] * len(ro.completions), dtype=torch.float32)
        assert torch.equal(ro.rewards, want), mode
        assert all(x.turn_rewards == [0.5, 0.5, 1.0] for x in ro.completions)
        assert all(x.env_reward == joined for x in ro.completions)


@register_source("toy_length")
class ToyLength:
    """A second reward source, registered from here: `options.scale` x the completion length;
    correct when the answer occurs in the prompt's record."""

    def __init__(self, cfg: RewardConfig) -> None:
        self.scale = float(cfg.options.get("scale", 1.0))

    @staticmethod
    def check(cfg: RewardConfig) -> None:
        if "scale" not in cfg.options:
            raise ValueError("reward.options.scale is missing: toy_length needs it")

    def score(self, samples):
        r = torch.tensor([self.scale * len(s.completion) for s in samples])
        return Scores(rewards=r, correct=torch.tensor([s.record.get("k") == 0 for s in samples]))

    def close(self):
        pass


def test_a_second_source_is_chosen_by_config():
    cfg = TrainConfig()
    cfg.reward.source, cfg.reward.options = "toy_length", {"scale": 0.5}
    cfg.reward.validate()
    check_source(cfg.reward)  # what the preflight runs
    c = collector(build_rewards(cfg.reward))  # what run.py's set-up builds
    ro = c.next(version=0)
    assert ro.rewards.tolist() == [0.5 * len(text(x)) for x in ro.completions]
    first = Tok().encode("p0")  # the prompt of the record with k == 0
    assert [x.correct for x in ro.completions] == [ro.prompts[x.prompt_index] == first
                                                   for x in ro.completions]
    with pytest.raises(ValueError, match="reward.options.scale"):
        check_source(RewardConfig(source="toy_length"))
    with pytest.raises(ValueError, match="reward.source='nope'"):
        check_source(RewardConfig(source="nope"))
    with pytest.raises(ValueError, match="reward.options=.*reward.source=rules"):
        RewardConfig(options={"scale": 1}).validate()


def test_score_chunks_score_the_first_groups_while_the_later_ones_sample():
    """reward.score_chunks=2: the engine samples half the prompts, the source gets those
    samples at once (a future), then the engine samples the rest; the gathered batch equals the
    one-call batch (same completions, same rewards, in the same order)."""
    events: list[tuple[str, int]] = []

    class LoggedEngine(FakeEngine):
        def generate(self, prompts, sampling):
            events.append(("generate", len(prompts)))
            return super().generate(prompts, sampling)

    class ByRecord(Recording):
        """The record's k plus a hundredth of the completion's length: slices out of order
        would give other samples' rewards."""

        def score(self, samples):
            r = torch.tensor([s.record["k"] + len(s.completion) / 100 for s in samples])
            return Scores(rewards=r, correct=r > 1.5)

    class LoggedSource(Later):
        def score(self, samples):
            events.append(("score", len(samples)))
            fut: Future = Future()
            self.futures.append((fut, ByRecord().score(samples)))
            return fut

    whole = collector(Rewards(ByRecord())).next(version=0)
    assert len(set(whole.rewards.tolist())) > 2
    src = LoggedSource()
    c = collector(Rewards(src))
    c.cfg.reward.score_chunks = 2
    c.engine = LoggedEngine()
    drawn = c.draw(version=0)
    assert events == [("generate", 2), ("score", 4), ("generate", 2), ("score", 4)]
    assert not any(f.done() for f, _ in src.futures)  # both still scoring after the draw
    for fut, scores in src.futures:
        fut.set_result(scores)
    ro = c.gather(drawn)
    assert [x.token_ids for x in ro.completions] == [x.token_ids for x in whole.completions]
    assert torch.equal(ro.rewards, whole.rewards)
    assert [x.correct for x in ro.completions] == [x.correct for x in whole.completions]


def test_slices_of_a_batch_merge_their_metrics_by_kind():
    """Means weighted by the slices' sizes, gauges by max, amounts added (by hand)."""
    from megagrpo.reward import concat_scores

    a = Scores(rewards=torch.tensor([1.0]), per_term={"t": torch.tensor([1.0])},
               metrics={"reward/t": 1.0, "reward_errors": 2.0, "reward_stuck_threads": 1.0},
               gauges=frozenset({"reward_stuck_threads"}))
    b = Scores(rewards=torch.tensor([4.0, 4.0, 4.0]), per_term={"t": torch.tensor([4.0] * 3)},
               metrics={"reward/t": 4.0, "reward_errors": 3.0, "reward_stuck_threads": 4.0},
               valid=torch.tensor([True, False, True]))
    out = concat_scores([a, b])
    assert out.rewards.tolist() == [1.0, 4.0, 4.0, 4.0]
    assert out.metrics == {"reward/t": 3.25, "reward_errors": 5.0, "reward_stuck_threads": 4.0}
    assert out.valid.tolist() == [True, True, False, True]
    assert out.correct.tolist() == [True, True, True, True]
