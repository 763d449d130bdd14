"""`AdapterSource` (megagrpo/sync/adapters.py) against a fake engine: which syncs send the base and
which only the adapters, for a fresh run and for a run resumed from a checkpoint with and
without a merge pending its refit. No ranks: the adapters' gather is replaced by a fixed set
of tensors, the base feed by a recorder that notes whether the adapters were off."""
from types import SimpleNamespace

import pytest
import torch

from megagrpo.config.lora import LoRAConfig
from megagrpo.sync import adapters as lora_refit
from megagrpo.sync.transports.reload import Reload

FULL_METRICS = {"sync_bytes": 1000, "sync_received_bytes": 1000, "sync_gather_s": 0.0,
                "sync_load_s": 0.0}
ADAPTER = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(4, 8),
           "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(8, 4)}
ADAPTER_BYTES = 2 * 32 * 4  # two float32 tensors of 32 elements


class Adapted(torch.nn.Module):
    """A linear carrying an adapter, as `megagrpo.lora.layers.adapted` finds them."""

    def __init__(self):
        super().__init__()
        self.lora_B = torch.nn.Parameter(torch.zeros(8, 4))
        self.lora_enabled = True


class FakeEngine:
    def __init__(self):
        self.adapters: list[str] = []

    def load_adapter(self, folder: str) -> None:
        self.adapters.append(folder)


class Harness:
    """One run's policy, engine and the refits the engine received: 'base' when the weight
    feed ran (it must run with the adapters off), then 'adapter' for each adapter load."""

    def __init__(self, tmp_path, monkeypatch):
        monkeypatch.setattr(lora_refit, "gather_adapters", lambda policy, model, parallel:
                            dict(ADAPTER))
        self.policy = torch.nn.Sequential(Adapted())
        self.engine = FakeEngine()
        self.refit = lora_refit.AdapterSource(LoRAConfig(rank=4), tmp_path / "adapters",
                                              self.engine, SimpleNamespace(model=None,
                                                                           parallel=None),
                                              Reload(self))
        self.log: list[str] = []

    def update_weights(self, pairs, dtypes=None):
        """The engine's update (the `reload` transport's): the base feed."""
        assert pairs == "base pairs"
        self.full_refit()
        return None

    def full_refit(self) -> dict:
        assert not self.policy[0].lora_enabled, "the base was fed with the adapters on"
        self.log.append("base")
        return dict(FULL_METRICS)

    def sync(self) -> dict:
        feed = SimpleNamespace(pairs="base pairs", dtypes=None,
                               metrics=lambda load: dict(FULL_METRICS))
        out = self.refit.refit(self.policy, lambda: feed, None)
        self.log.append("adapter")
        assert self.policy[0].lora_enabled  # back on after the base feed
        assert self.engine.adapters[-1].endswith(f"adapter_{len(self.engine.adapters)}")
        return out

    def syncs(self, n: int) -> list[bool]:
        """`n` syncs; for each, whether it sent the base."""
        sent = []
        for _ in range(n):
            before = self.log.count("base")
            out = self.sync()
            sent.append(self.log.count("base") > before)
            assert out["sync_base"] == float(sent[-1])
            assert out["sync_adapter_bytes"] == ADAPTER_BYTES
            assert out["sync_bytes"] == ADAPTER_BYTES + (1000 if sent[-1] else 0)
        return sent


def test_fresh_run_sends_the_base_first_and_after_a_merge(tmp_path, monkeypatch):
    h = Harness(tmp_path, monkeypatch)
    assert h.syncs(2) == [True, False]
    h.refit.base_changed()  # a merge (reference reset)
    assert h.refit.state_dict() == {"adapter_base_stale": True}
    assert h.syncs(2) == [True, False]
    assert h.refit.state_dict() == {"adapter_base_stale": False}
    assert len(list((tmp_path / "adapters").iterdir())) == 1  # older adapter folders removed


@pytest.mark.parametrize("pending_merge", [False, True])
def test_resumed_run_sends_the_base_to_its_new_engine(tmp_path, monkeypatch, pending_merge):
    """A resumed run's engine starts from vLLM's initial weights, so its first sync sends the
    base whatever the checkpoint says; its second sends the base again exactly when the run it
    continues had a merge pending (the refit the uninterrupted run would have made)."""
    before = Harness(tmp_path / "before", monkeypatch)
    before.syncs(1)
    if pending_merge:
        before.refit.base_changed()
    state = before.refit.state_dict()

    after = Harness(tmp_path / "after", monkeypatch)
    after.refit.load_state_dict(state)
    assert after.syncs(3) == [True, pending_merge, False]
