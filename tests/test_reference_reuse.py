"""compute.reuse_equal_reference under algo.routing_replay (issue 28 defect).

With routing replay the policy's scoring pass routes every token to the experts vLLM chose,
while the reference routes by itself (algo.routing_replay's documentation). So even when the
reference's weights equal the policy's, its log-probs are not the replayed old log-probs: the
shortcut that copies them must be off. `Trainer.score` is driven with a scoring stub that tags
each pass by the model it ran on; without routing replay the copy is still taken.
"""
import torch

from megagrpo.config.train import TrainConfig
from megagrpo.parallel.batch import Batch
from megagrpo.train.trainer import Trainer, may_reuse_reference


class Scoring:
    """Stands in for `Passes`: log-probs [N, S] filled with the id of the model scored."""

    def __init__(self):
        self.scored = []

    def gradient_rows(self, batch, loss_has_kl):
        return None  # every row trains

    def logprobs(self, model, batch, rows=None):
        self.scored.append(model.tag)
        return torch.full((2, 3), float(model.tag))


class Model(torch.nn.Linear):
    def __init__(self, tag: int):
        super().__init__(1, 1)
        self.tag = tag


class EqualReference:
    """A reference whose weights equal the policy's (just reset)."""

    def __init__(self):
        self.model = Model(2)

    def equals(self, policy, group=None):
        return True

    def onload(self):
        pass

    def offload(self):
        pass


def score(routing_replay: bool):
    cfg = TrainConfig()
    cfg.algo.mu, cfg.algo.routing_replay = 2, routing_replay  # mu > 1: old log-probs scored
    cfg.compute.reuse_equal_reference = True
    tr = Trainer(cfg, policy=Model(1), reference=EqualReference())
    tr.passes = Scoring()
    out = tr.score(Batch.__new__(Batch), async_batch=False)
    return out, tr.passes.scored


def test_reference_pass_runs_under_routing_replay():
    out, scored = score(routing_replay=True)
    assert scored == [1, 2] and out.reference_reused is False
    assert torch.equal(out.ref_logp, torch.full((2, 3), 2.0))  # the reference's own routing


def test_equal_reference_still_reused_without_replay():
    out, scored = score(routing_replay=False)
    assert scored == [1] and out.reference_reused is True
    assert torch.equal(out.ref_logp, out.old_logp) and out.ref_logp is not out.old_logp


def test_decision_needs_every_row_and_old_logprobs():
    cfg = TrainConfig()
    assert may_reuse_reference(cfg.compute, cfg.algo, all_rows=True, old_scored=True)
    assert not may_reuse_reference(cfg.compute, cfg.algo, all_rows=False, old_scored=True)
    assert not may_reuse_reference(cfg.compute, cfg.algo, all_rows=True, old_scored=False)
    cfg.algo.routing_replay = True
    assert not may_reuse_reference(cfg.compute, cfg.algo, all_rows=True, old_scored=True)
