"""reference.alpha < 1 mixes at most once per policy version (issue 30, item 5).

A steps reset after step k (`due_after`) and an epoch reset before step k + 1 (`due_before`)
fall on consecutive `Trainer._reset_reference` calls with no update between: mixing twice
would make the effective alpha 1 - (1 - alpha)^2 (0.51 for alpha 0.3). Driven with real (tiny)
modules in the order `Trainer.step` makes the calls; the reference is compared with
alpha * policy + (1 - alpha) * ref computed in float64.
"""
import torch

from megagrpo.config.train import TrainConfig
from megagrpo.model.reference import Reference, ReferenceState
from megagrpo.train.trainer import Trainer

ALPHA = 0.3


def _trainer() -> tuple[Trainer, torch.nn.Module, Reference]:
    torch.manual_seed(0)
    policy, ref_model = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    cfg = TrainConfig()
    cfg.reference.alpha, cfg.reference.sync_every_steps = ALPHA, 2
    cfg.reference.sync_every_epoch = True
    ref = Reference.__new__(Reference)  # the model is built by megatron in a run; here a Linear
    ref.cfg, ref.state, ref.model = cfg.reference, ReferenceState(), ref_model
    ref._offloaded = False
    return Trainer(cfg, policy=policy, reference=ref), policy, ref


def _params(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def _mixed_once(policy: dict, ref: dict) -> dict:
    return {n: ALPHA * policy[n].double() + (1 - ALPHA) * ref[n].double() for n in ref}


def _close(got: dict, want: dict) -> bool:
    return all(torch.allclose(got[n].double(), want[n], rtol=0, atol=1e-6) for n in want)


def _update(tr: Trainer, policy: torch.nn.Module) -> None:
    """An applied optimizer update: the policy moves, its version advances."""
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p))
    tr.version += 1


def test_steps_then_epoch_reset_mix_once():
    tr, policy, ref = _trainer()
    r0 = _params(ref.model)
    _update(tr, policy)  # step 1
    tr.step_idx = 1
    assert ref.due_after(1, None) is None
    _update(tr, policy)  # step 2
    tr.step_idx = 2
    p2 = _params(policy)
    assert tr._reset_reference(ref.due_after(2, None), 0) == "steps"
    once = _mixed_once(p2, r0)
    assert _close(_params(ref.model), once)
    # step 3 opens epoch 1 before any update: the epoch reset is due, the mix already done
    assert tr._reset_reference(ref.due_before(1), 1) == "epoch"
    got = _params(ref.model)
    assert _close(got, once)
    twice = _mixed_once(p2, {n: once[n].float() for n in once})
    assert not _close(got, twice)  # what the second mix gave (effective alpha 0.51)
    assert ref.state == ReferenceState(syncs=1, last_sync_step=2, last_epoch=1,
                                       last_sync_version=2)
    assert ref.due_before(1) is None  # the epoch's reset is recorded
    # the next update moves the policy: the next reset mixes again
    _update(tr, policy)  # step 3
    _update(tr, policy)  # step 4
    tr.step_idx = 4
    p4 = _params(policy)
    assert tr._reset_reference(ref.due_after(4, None), 1) == "steps"
    assert _close(_params(ref.model), _mixed_once(p4, {n: v.float() for n, v in got.items()}))
    assert ref.state.syncs == 2 and ref.state.last_sync_version == 4


def test_reset_after_a_skipped_update_does_not_mix():
    """A step whose update was skipped (bad rewards) leaves the version: a reset due then
    moves the schedule without mixing the same policy in again."""
    tr, policy, ref = _trainer()
    _update(tr, policy)
    tr.step_idx = 2
    tr._reset_reference("steps", 0)
    after = _params(ref.model)
    tr.step_idx = 4  # steps 3 and 4 skipped their updates
    assert tr._reset_reference(ref.due_after(4, None), 0) == "steps"
    assert all(torch.equal(after[n], p) for n, p in _params(ref.model).items())
    assert ref.state.last_sync_step == 4 and ref.state.syncs == 1


def test_state_written_before_the_version_field_loads():
    ref = Reference.__new__(Reference)
    ref.load_state_dict({"syncs": 3, "last_sync_step": 6, "last_epoch": 1})
    assert ref.state.last_sync_version == -1  # the next reset mixes


def test_alpha_one_is_a_copy():
    tr, policy, ref = _trainer()
    ref.cfg.alpha = 1.0
    _update(tr, policy)
    tr._reset_reference("epoch", 1)
    assert all(torch.equal(a, b) for a, b in zip(policy.parameters(), ref.model.parameters()))
