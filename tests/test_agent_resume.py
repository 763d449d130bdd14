"""Issue 29, resume of multi-turn runs. The end-to-end check (`-m heavy`, tests/test_resume.py
with scripts/resume_stress.py's 'agent+async' mode: a real `megagrpo train` SIGKILLed inside a
multi-turn step, resumed, bitwise the uninterrupted run) is heavy; by default this checks its
piece that single-turn runs do not exercise: the pending multi-turn batch (async rollouts) goes
through the checkpoint's state file and comes back exactly, masks with their holes, per-turn
counts and truncations included, without pickle."""
from __future__ import annotations

import dataclasses

from megagrpo.checkpoint import load_tree, save_tree
from megagrpo.rollout.collect import Drawn
from tests.test_agent_runner import Counter, Endless, run


def _drawn() -> Drawn:
    """A batch of real runner trajectories: 3 turns with tool calls (Counter), and ones cut by
    the turn limit (Endless), so masks have holes and truncations differ."""
    done, _, _ = run(Counter)
    cut, _, _ = run(Endless, max_turns=2)
    comps = done + cut
    return Drawn(prompts=[[1, 2, 3], [4, 5]], answers=["6", "9"], epoch=1, version=3,
                 completions=comps, rewards=[0.25 * i for i in range(len(comps))],
                 metrics={"turns": 2.5, "truncated/max_turns": 0.5},
                 loader_state={"index": 4, "epoch": 1, "seed": 7})


def test_pending_multi_turn_batch_round_trips_through_the_state_file(tmp_path):
    drawn = _drawn()
    assert {c.turns for c in drawn.completions} == {2, 3}  # a real multi-turn batch
    assert all(c.loss_mask is not None and not all(c.loss_mask) for c in drawn.completions)
    assert {c.truncation for c in drawn.completions} == {"", "max_turns"}
    path = tmp_path / "rank00000.safetensors"
    save_tree(path, {"pending": drawn.state_dict()})  # what the checkpoint's rollout/ holds
    back = Drawn.from_state(load_tree(path)["pending"])
    assert back == drawn
    for a, b in zip(drawn.completions, back.completions):
        for f in dataclasses.fields(a):  # == alone would take 1 for True, 1.0 for 1
            x, y = getattr(a, f.name), getattr(b, f.name)
            assert type(x) is type(y), f.name
            if isinstance(x, list):
                assert [type(v) for v in x] == [type(v) for v in y], f.name
    # the control: a batch with one environment token turned into a model token differs
    other = Drawn.from_state(load_tree(path)["pending"])
    mask = other.completions[0].loss_mask
    mask[mask.index(False)] = True
    assert other != drawn
