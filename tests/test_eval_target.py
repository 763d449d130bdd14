"""eval.target_accuracy: GRPO stops at the first periodic evaluation that reaches it
(`megagrpo.train.eval_target`). End to end, as a user runs it: a tiny 1-rank run whose every greedy
answer counts as correct (`full_marks`, the correctness term) stops after the first evaluation,
says so, and records the step in its metrics, summary and checkpoint; resumed with a larger
run.steps it runs no further step (`-m heavy`: a second launch). The rest: the config checks
and the resume rule."""
import json
import sys
from pathlib import Path

import pytest

from megagrpo.config.train import load_config
from megagrpo.train.eval_target import EvalTarget
from tests.support.cli import run_cli

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import resume_stress as stress  # noqa: E402 - the tiny model of the resume tests

DEMO = ROOT / "examples" / "demo.yaml"


def full_marks(completion: str, answer: str) -> float:
    """Every completion correct: held-out accuracy is 1 at any evaluation."""
    return 1.0


@pytest.mark.parametrize("value", ["1.5", "-0.1"])
def test_bad_targets_are_refused_naming_the_field(value):
    cfg = load_config(str(DEMO), [f"eval.target_accuracy={value}"])
    with pytest.raises(ValueError, match=rf"eval\.target_accuracy={value} must be in \[0, 1\]"):
        cfg.validate()


def test_first_evaluation_at_the_target_stops_once():
    t = EvalTarget(0.9)
    assert not t.check(25, 0.895) and not t.reached
    assert t.check(50, 0.9) and t.reached_step == 50 and t.accuracy == 0.9
    assert not t.check(75, 0.95) and t.reached_step == 50  # the first one counts
    assert t.summary() == {"eval_target_accuracy": 0.9, "eval_target_step": 50}
    off = EvalTarget(0.0)
    assert not off.check(25, 1.0) and off.summary() == {}


@pytest.mark.parametrize("target, stays_stopped", [(0.9, True), (0.85, True), (0.95, False),
                                                   (0.0, False)])
def test_resume_keeps_a_reached_target_unless_this_run_asks_for_more(target, stays_stopped):
    saved = EvalTarget(0.9)
    saved.check(50, 0.92)
    resumed = EvalTarget(target)
    resumed.load_state_dict(json.loads(json.dumps(saved.state_dict())))
    assert resumed.reached is stays_stopped
    assert resumed.reached_step == (50 if stays_stopped else None)
    old = EvalTarget(0.9)
    old.load_state_dict({"step": 40})  # a checkpoint written before this part existed
    assert not old.reached


def _tiny_args(out: Path) -> list[str]:
    return [*stress.tiny_overrides(out, 6, checkpoint_every=0), "log.progress=false",
            "reward.terms=[{name: 'tests.test_eval_target:full_marks'}]", "eval.every=2",
            "eval.target_accuracy=0.5"]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> Path:
    """A tiny 1-rank run that reaches its target at the first evaluation (after step 2 of 6)."""
    out = tmp_path_factory.mktemp("eval_target") / "run"
    first = run_cli("train", "--nproc", "1", *_tiny_args(out), timeout=600)
    console = first.stdout + first.stderr
    assert first.returncode == 0, console[-4000:]
    (out.parent / "console.txt").write_text(console)
    return out


def test_run_stops_at_the_target(stopped):
    out = stopped
    console = (out.parent / "console.txt").read_text()
    assert "held-out accuracy 1.000 >= eval.target_accuracy=0.5 after GRPO step 2: the run " \
           "stops here; 4 of run.steps=6 left unused" in console, console[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["eval_target_step"] == 2
    assert summary["eval_accuracy_after"] == 1.0 and summary["eval_target_accuracy"] == 0.5
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert stress.logged_steps(out) == [1, 2]
    # one evaluation per step: the stop's is not repeated after the loop
    assert [(r["step"], r["eval_accuracy"]) for r in records if "eval_accuracy" in r] \
        == [(0, 1.0), (2, 1.0)]
    assert [r["step"] for r in records if "eval_target_step" in r] == [2]
    state = json.loads((out / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert state["eval_target_step"] == 2 and state["eval_target_reached_accuracy"] == 1.0


@pytest.mark.heavy  # a second launch (~20 s); the resume rule itself is unit-tested above
def test_a_resumed_run_that_reached_the_target_runs_no_further_step(stopped):
    out = stopped
    again = run_cli("train", "--nproc", "1", *_tiny_args(out), "run.steps=10",
                    "run.resume=true", timeout=600)
    console = again.stdout + again.stderr
    assert again.returncode == 0, console[-4000:]
    assert "reached eval.target_accuracy=0.5 after GRPO step 2: no step left to run" in console
    assert stress.logged_steps(out) == [1, 2]
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
