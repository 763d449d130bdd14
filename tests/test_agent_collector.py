"""The rollout collector with the agent on (fake engine, no vLLM): environment rewards join the
reward terms', the batch carries the masks and the agent metrics, evaluation runs multi-turn,
and a pending async multi-turn batch survives the checkpoint round trip (save_tree/load_tree)
with its masks."""
from __future__ import annotations

import dataclasses

import torch

from megagrpo.checkpoint import load_tree, save_tree
from megagrpo.config.layout import RolloutLayout
from megagrpo.config.train import TrainConfig
from megagrpo.data import Example, PromptLoader
from megagrpo.reward import EnvironmentRewards, Rewards, Scores
from megagrpo.rollout.collect import RolloutCollector
from megagrpo.train.advantage import build_batch
from tests.test_agent_runner import VOCAB, FakeEngine, sample


class Tok:
    bos_id = None

    def encode(self, text):  # prompts 'p<i>' and the Counter's observations '<n> <k>'
        if text.startswith("p"):
            return [1, 2 + int(text[1:])]
        return [VOCAB + int(x) for x in text.split()]

    def decode(self, ids):
        return " ".join(map(str, ids))


class Reward:
    """A reward source: 1 for an odd-length last turn."""

    def score(self, samples):
        r = torch.tensor([float(len(s.completion) % 2) for s in samples])
        return Scores(rewards=r, per_term={"r": r}, correct=r >= 1)

    def close(self):
        pass


def collector(tmp_path) -> RolloutCollector:
    cfg = TrainConfig()
    cfg.agent.environment = "tests.test_agent_runner:Counter"
    cfg.run.async_rollout, cfg.algo.group_size, cfg.rollout.max_tokens = True, 2, 8
    data = [Example(prompt=f"p{i}", answer="a", record={"k": i}) for i in range(8)]
    return RolloutCollector(cfg=cfg, engine=FakeEngine(), loader=PromptLoader(data, 4, seed=1),
                            tokenizer=Tok(),
                            rewards=Rewards(Reward(), EnvironmentRewards(cfg.agent.env_reward)),
                            layout=RolloutLayout(rank=0, world_size=1, engine_tp=1, train_tp=1,
                                                 train_pp=1))


def test_pending_multi_turn_batch_survives_checkpoint(tmp_path):
    c = collector(tmp_path)
    ro = c.next(version=0)
    c.join()
    assert len(ro.completions) == 8 and all(x.turns == 3 for x in ro.completions)
    # the Counter's rewards (0.5 + 0.5 + 1.0) joined the reward terms'
    texts = [x.text for x in ro.completions]
    assert torch.equal(ro.rewards, torch.tensor([len(t) % 2 + 2.0 for t in texts]))
    batch, shaped = build_batch(ro, c.cfg, pad_id=0, multiple=1)
    assert int(batch.mask.sum()) == sum(sum(x.loss_mask) for x in ro.completions)
    assert shaped.metrics["turns"] == 3 and shaped.metrics["tool_calls"] == 2
    assert shaped.metrics["completion_len"] == 12 and shaped.metrics["trajectory_len"] == 16

    save_tree(tmp_path / "rollout.safetensors", c.state_dict())
    c2 = collector(tmp_path)
    c2.load_state_dict(load_tree(tmp_path / "rollout.safetensors"))
    want, got = c.pending.completions, c2.pending.completions
    assert len(got) == 8 and any(False in x.loss_mask for x in got)
    assert [dataclasses.asdict(x) for x in got] == [dataclasses.asdict(x) for x in want]
    assert c2.pending.rewards == c.pending.rewards
    ro2 = c2.rollout(0, c2.pending)  # the restored batch trains like the original
    b1, _ = build_batch(c.rollout(0, c.pending), c.cfg, pad_id=0, multiple=1)
    b2, _ = build_batch(ro2, c2.cfg, pad_id=0, multiple=1)
    assert torch.equal(b1.mask, b2.mask) and torch.equal(b1.ids, b2.ids)
    assert torch.equal(b1.rollout_logp, b2.rollout_logp)


def greedy_text(i: int) -> str:
    """The last turn's text of example `i`'s greedy trajectory, replayed from the fake engine's
    rule: prompt 'p<i>' -> [1, 2 + i]; three turns of 4 ids (sample index 0), the Counter's
    observation '<turn> <k>' between them."""
    seq = [1, 2 + i]
    for turn in range(3):
        ids, _ = sample(seq, 0, 64, 4)
        seq += ids
        if turn < 2:
            seq += [VOCAB + turn, VOCAB + i]
    return " ".join(map(str, ids))


def test_evaluation_runs_multi_turn(tmp_path):
    """Greedy multi-turn evaluation: every turn's call is greedy with rollout.stop, and the
    accuracy is the hand-counted share whose correctness term (odd text length) is met; the
    Counter's env reward (2 per trajectory) must not count (summed rewards are all >= 2)."""
    c = collector(tmp_path)
    c.cfg.rollout.stop = ["</answer>"]
    data = [Example(prompt=f"p{i}", answer="a", record={"k": i}) for i in range(8)]
    want = sum(len(greedy_text(i)) % 2 for i in range(8)) / 8
    assert 0 < want < 1  # the reference tells right from wrong
    acc = c.evaluate(data)
    calls = c.engine.calls
    assert len(calls) == 3 and all(s.temperature == 0.0 and s.n == 1 for _, s in calls)
    assert all(s.stop == ("</answer>",) for _, s in calls)  # rollout.stop reaches the engine
    assert acc == want


def test_console_line_shows_turns_and_tool_calls_when_the_agent_is_on():
    from megagrpo.runtime.console import Progress

    p = Progress(10, enabled=False)
    assert p.figures({"reward_mean": 1.0, "turns": 2.5, "tool_calls": 1.25}) == (
        "reward=1 turns=2.5 tools=1.25")
    assert "turns" not in p.figures({"reward_mean": 1.0})  # single-turn runs: unchanged
