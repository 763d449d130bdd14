"""Reward functions: built-ins, user import strings, weighted sums, errors and timeouts."""
import importlib
import logging
import textwrap
import threading
import time

import pytest
import torch

from megagrpo import reward as rewards
from megagrpo.config.data import RewardConfig, RewardTermConfig

USER_MODULE = """
import threading
import time

RELEASE = threading.Event()  # the test sets it at the end; worker processes never see it set

def hang(completion, answer):
    RELEASE.wait()
    return 1.0

def slow(completion, answer):
    time.sleep(1.0)
    return 1.0

def boom(completion, answer):
    raise RuntimeError("user bug")

def nan(completion, answer):
    return float("nan")

def length(completion, answer, scale=1.0):
    return scale * len(completion)
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards"


def test_exact_match_normalisation():
    assert rewards.exact_match_reward(" 1,000. ", "1000") == 1.0
    assert rewards.exact_match_reward("$Paris$", "paris") == 1.0
    assert rewards.exact_match_reward("12", "13") == 0.0
    text = "first #### 3\nthen #### 42"
    assert rewards.exact_match_reward(text, "42", pattern=r"#### (\S+)") == 1.0
    assert rewards.exact_match_reward("no marker", "42", pattern=r"#### (\S+)") == 0.0


def test_format_reward():
    pat = r"<think>.*</think>\s*<answer>.*</answer>"
    assert rewards.format_reward("<think>a\nb</think> <answer>3</answer>", "", pattern=pat) == 1.0
    assert rewards.format_reward("<answer>3</answer>", "", pattern=pat) == 0.0
    assert rewards.format_reward("x <answer>3</answer>", "", pattern="<answer>", full=False) == 1.0


def test_math_verify_reward_in_worker_threads():
    cfg = RewardConfig(terms=[RewardTermConfig(name="math")], timeout_s=20.0)
    total, _, metrics = rewards.RuleTerms(cfg).score_texts(
        ["The answer is $\\frac{1}{2}$.", "so \\boxed{0.5}", "it is $3$"],
        ["0.5", "$\\frac12$", "4"],
    )
    assert total.tolist() == [1.0, 1.0, 0.0]
    assert metrics["reward_errors"] == 0 and metrics["reward_timeouts"] == 0


def test_math_verify_reward_in_main_thread():
    assert rewards.math_reward("x = \\boxed{2+2}", "4") == 1.0


def test_weighted_sum_and_user_function(user_module):
    cfg = RewardConfig(terms=[
        {"name": "exact_match", "weight": 2.0},
        {"name": f"{user_module}:length", "weight": 0.5, "kwargs": {"scale": 0.1}},
        {"name": "exact_match", "weight": 1.0, "kwargs": {"pattern": r"(\d+)$"}},
    ])
    total, per_term, metrics = rewards.RuleTerms(cfg).score_texts(["7", "ab 8"], ["7", "8"])
    em = [1.0, 0.0]
    length = [0.1 * 1, 0.1 * 4]
    em2 = [1.0, 1.0]
    for i in range(2):
        assert total[i].item() == pytest.approx(2 * em[i] + 0.5 * length[i] + em2[i])
    assert set(per_term) == {"exact_match", f"{user_module}:length", "exact_match#1"}
    assert per_term["exact_match"].tolist() == em
    assert metrics["reward/exact_match#1"] == 1.0


def test_errors_and_timeouts_score_zero_and_are_counted(user_module):
    cfg = RewardConfig(
        terms=[{"name": f"{user_module}:slow"}, {"name": f"{user_module}:boom"},
               {"name": f"{user_module}:nan"}, {"name": "exact_match", "weight": 10.0}],
        timeout_s=0.2,
    )
    t0 = time.perf_counter()
    total, per_term, metrics = rewards.RuleTerms(cfg).score_texts(["5", "6"], ["5", "5"])
    elapsed = time.perf_counter() - t0
    assert elapsed < 1.0  # two 0.2 s deadlines, not two 1 s sleeps
    assert total.tolist() == [10.0, 0.0]
    assert per_term[f"{user_module}:slow"].tolist() == [0.0, 0.0]
    assert metrics["reward_timeouts"] == 2
    assert metrics["reward_errors"] == 4  # 2 raised + 2 NaN
    assert metrics["reward_stuck_threads"] >= 1


def test_resolve_errors_and_config_validation():
    with pytest.raises(ValueError, match="module:function"):
        rewards.resolve_reward("no_such_builtin")
    with pytest.raises(ValueError, match="reward.timeout_s"):
        RewardConfig(timeout_s=0).validate()
    with pytest.raises(ValueError, match="reward.terms"):
        RewardConfig(terms=[]).validate()
    with pytest.raises(ValueError, match="reward.isolation"):
        RewardConfig(isolation="fork").validate()


def test_no_isolation_calls_directly():
    cfg = RewardConfig(terms=[{"name": "exact_match"}], isolation="none")
    total, _, _ = rewards.RuleTerms(cfg).score_texts(["a"], ["A"])
    assert torch.equal(total, torch.tensor([1.0]))


def test_process_isolation_kills_overrunning_calls(user_module):
    """Slow: each pool (re)start spawns a worker that imports torch (~1-2 s)."""
    cfg = RewardConfig(
        terms=[{"name": f"{user_module}:slow"}, {"name": f"{user_module}:boom"},
               {"name": f"{user_module}:length", "kwargs": {"scale": 2.0}}],
        timeout_s=0.2, isolation="process", num_workers=1,
    )
    scorer = rewards.RuleTerms(cfg)
    try:
        total, per_term, metrics = scorer.score_texts(["abc"], [""])
        assert per_term[f"{user_module}:slow"].tolist() == [0.0]
        assert total.tolist() == [6.0]  # the pool came back after the kill
        assert metrics["reward_timeouts"] == 1 and metrics["reward_errors"] == 1
        assert metrics["reward_pool_restarts"] == 1
    finally:
        scorer.close()
    assert scorer.processes.pool is None


def _wait_for_reward_threads_to_end(limit_s: float = 5.0) -> None:
    deadline = time.monotonic() + limit_s
    while rewards.stuck_reward_threads() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_hanging_reward_leaves_a_bounded_number_of_threads(user_module, caplog):
    """A reward that never returns: thread isolation abandons at most max_stuck_threads calls,
    then the run moves to (killable) worker processes with one warning. Slow: a pool start per
    hanging call once in processes."""
    _wait_for_reward_threads_to_end()  # threads of earlier tests' slow rewards
    # only abandoned calls count: the reward model's idle pool thread (its source is built by
    # tests/test_reward_model.py, "megagrpo-reward-model_0") was once counted as stuck
    assert rewards.stuck_reward_threads() == 0, [t.name for t in threading.enumerate()]
    cfg = RewardConfig(terms=[{"name": f"{user_module}:hang"}, {"name": "exact_match"}],
                       timeout_s=0.1, max_stuck_threads=3, num_workers=1)
    scorer = rewards.RuleTerms(cfg)
    stuck, isolation = [], []
    try:
        with caplog.at_level(logging.WARNING, logger="megagrpo"):
            for _ in range(3):
                total, per_term, m = scorer.score_texts(["7", "8"], ["7", "7"])
                assert total.tolist() == [1.0, 0.0]  # exact_match still counts, the hang is 0
                assert per_term[f"{user_module}:hang"].tolist() == [0.0, 0.0]
                assert m["reward_timeouts"] == 2
                stuck.append(m["reward_stuck_threads"])
                isolation.append(m["reward_process_isolation"])
        # 2 calls abandoned in the first score, 1 more in the second, then the cap holds
        assert stuck == [2, 3, 3] and rewards.stuck_reward_threads() == 3
        assert isolation == [0.0, 1.0, 1.0]
        switches = [r for r in caplog.records if "max_stuck_threads=3" in r.getMessage()]
        assert len(switches) == 1 and "isolation=process" in switches[0].getMessage()
        assert m["reward_pool_restarts"] >= 1  # the hanging calls' workers were killed
    finally:
        importlib.import_module(user_module).RELEASE.set()
        scorer.close()
        _wait_for_reward_threads_to_end()


def test_max_stuck_threads_is_range_checked():
    with pytest.raises(ValueError, match=r"reward\.max_stuck_threads=0"):
        RewardConfig(max_stuck_threads=0).validate()
