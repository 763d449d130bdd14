"""benchmarks/demo_seeds_report.py: the demo's seed runs as tables. The README's one line per
CPU kind (`--summary`) and docs/performance.md's row per run are the generator's output on the
kept runs (benchmarks/results/demo_seeds_cpu/), none typed by hand; the kept runs are the
recipe's; a synthetic set of runs gives the hand-computed summary line."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from megagrpo.config.train import load_config
from tests.support.docs import assert_generated_table, body_rows, table_lines

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "demo.yaml"
SCRIPT = ROOT / "benchmarks" / "demo_seeds_report.py"


def _report():
    spec = importlib.util.spec_from_file_location("demo_seeds_report", SCRIPT)
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    return report


def test_performance_doc_seed_table_is_generated_from_the_kept_runs():
    """docs/performance.md's demo figures are the generator's table of the kept runs."""
    assert_generated_table(ROOT / "docs" / "performance.md", "<!-- demo-seeds:start",
                           "<!-- demo-seeds:end", _report().table())


def test_summary_script_prints_the_readme_table():
    """`demo_seeds_report.py --summary` (the command the README names) prints one line per CPU
    kind that has runs, and the README holds exactly that table."""
    out = subprocess.run([sys.executable, str(SCRIPT), "--summary"], capture_output=True,
                         text=True, check=True, timeout=60).stdout
    report = _report()
    assert out.strip() == report.summary()
    assert len(body_rows(table_lines(out))) == len(report.KINDS)
    assert_generated_table(ROOT / "README.md", "<!-- demo-summary:start",
                           "<!-- demo-summary:end", out)


def _write_run(folder: Path, seed: int, tag: str, summary: dict, wall: float) -> None:
    (folder / f"seed{seed}-{tag}-summary.json").write_text(json.dumps(summary))
    (folder / f"seed{seed}-{tag}-run.json").write_text(
        json.dumps({"wall_seconds_command": wall, "load_mean": 3.0}))


def test_summary_line_of_synthetic_runs(tmp_path):
    """Seed 1 has a run in the newer tag and the older one (the newer counts), seed 2 only in
    the older one, where it hit the cap; a kind without runs makes no line. By hand: start
    0.0 both; cold start 0.3 / 0.41; after GRPO 0.95 / 0.9; steps 500 / 650 + 300 / 600, one
    of two at the target; wall 125.4 s = 2 min 05 s, 610.6 s = 10 min 11 s."""
    def run(sft_steps, sft_acc, steps, after, target_step):
        return {"eval_accuracy_init": 0.0, "sft_steps": sft_steps, "sft_eval_accuracy": sft_acc,
                "steps": steps, "eval_accuracy_after": after, "eval_target_accuracy": 0.92,
                "eval_target_step": target_step}

    _write_run(tmp_path, 1, "new", run(500, 0.3, 300, 0.95, 300), 125.4)
    _write_run(tmp_path, 1, "old", run(700, 0.1, 100, 0.5, 100), 999.0)
    _write_run(tmp_path, 2, "old", run(650, 0.41, 600, 0.9, None), 610.6)
    got = _report().summary(tmp_path, {"CPU X": ("new", "old"), "CPU Y": ("none",)})
    assert body_rows(table_lines(got)) == [
        "| CPU X | 1, 2 | 0.000 -> 0.300-0.410 -> 0.900-0.950 | 500-650 + 300-600 (1 of 2 "
        "reached 0.92) | 2 min 05 s - 10 min 11 s |"]


def test_kept_seed_runs_are_the_recipe_and_keep_the_readme_promise():
    """Each kept seed run ran examples/demo.yaml's target and cap (the README names both) and
    ended above the README's 0.9; the current recipe's runs (rows' default tag) cover seeds
    1, 2, 3, and no tag holds a seed twice."""
    cfg = load_config(str(DEMO))
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"reaches {cfg.eval.target_accuracy:g} (`eval.target_accuracy`), at most " \
           f"{cfg.run.steps} steps (`run.steps`)" in readme
    assert "The promise is a held-out accuracy above 0.9" in readme
    report = _report()
    assert [r["seed"] for r in report.rows()] == [1, 2, 3]
    runs = [r for tag in report.TAGS for r in report.rows(tag=tag)]
    for tag in report.TAGS:
        seeds = [r["seed"] for r in report.rows(tag=tag)]
        assert seeds and seeds == sorted(set(seeds)) and set(seeds) <= {1, 2, 3}, tag
    assert {t for tags in report.KINDS.values() for t in tags} <= set(report.TAGS)
    for r in runs:
        s = r["summary"]
        assert s["eval_target_accuracy"] == cfg.eval.target_accuracy and s["steps"] <= cfg.run.steps
        assert s["eval_accuracy_after"] > 0.9
        if s["eval_target_step"] is not None:
            assert s["eval_target_step"] == s["steps"]
            assert s["eval_accuracy_after"] >= cfg.eval.target_accuracy
