"""Held-out accuracy is measured on the correctness term, not on the summed reward: a bonus
term (here a format reward that always pays 1) must not make a wrong answer correct. The
trainer's `evaluate` on real engines is checked in tests/_trainer_worker.py."""
import pytest
import torch

from megagrpo.config.data import RewardConfig, RewardTermConfig
from megagrpo.reward import RuleTerms

ALWAYS = dict(name="format", kwargs={"pattern": ".*"})  # 1.0 for any completion


def test_first_term_decides_by_default():
    fn = RuleTerms(RewardConfig(terms=[RewardTermConfig(name="arithmetic"),
                                      RewardTermConfig(**ALWAYS)]))
    total, per_term, _ = fn.score_texts(["19", "5", ""], ["19", "19", "3"])
    assert total.tolist() == [2.0, 1.0, 1.0]  # the sum would call every answer correct
    assert fn.correctness_label == "arithmetic"
    assert fn.correct(per_term).tolist() == [True, False, False]


def test_marked_term_decides_and_weights_do_not_count():
    terms = [RewardTermConfig(**ALWAYS, weight=0.1),
             RewardTermConfig(name="arithmetic", weight=0.5, correctness=True)]
    fn = RuleTerms(RewardConfig(terms=terms))
    total, per_term, _ = fn.score_texts(["19", "5"], ["19", "19"])
    assert torch.allclose(total, torch.tensor([0.6, 0.1]))  # weighted sums stay below 1
    assert fn.correct(per_term).tolist() == [True, False]  # the unweighted term is 1


def test_two_marked_terms_are_rejected():
    terms = [RewardTermConfig(name="arithmetic", correctness=True),
             RewardTermConfig(**ALWAYS, correctness=True)]
    with pytest.raises(ValueError, match="correctness"):
        RewardConfig(terms=terms).validate()
