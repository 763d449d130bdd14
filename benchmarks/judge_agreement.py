"""docs/rewards.md's judge table: SmolLM2-135M-Instruct rewarded by a judge (itself) next to the
same model rewarded by the rule, from the two runs of examples/smollm2-135m-judge-cpu.yaml kept
in benchmarks/results/judge_smollm2_cpu/ (each run's summary.json and metrics.jsonl).

    python -m megagrpo train --config examples/smollm2-135m-judge-cpu.yaml run.out_dir=R/judge \\
        run.steps=4 data.eval_path=data/word_problems/eval50.jsonl
    python -m megagrpo train --config examples/smollm2-135m-judge-cpu.yaml run.out_dir=R/rule \\
        run.steps=4 data.eval_path=data/word_problems/eval50.jsonl \\
        reward.sources.0.weight=1.0 reward.sources.1.weight=0.0
    .venv/bin/python benchmarks/judge_agreement.py [R]

(eval50.jsonl: the first 50 lines of the task's eval.jsonl; the kept runs: an Intel Xeon of
family 6 model 167, AVX512, 2 cores, beside other jobs.)

Rows, one per run (`judge`, `rule`: which source's weight is 1): held-out greedy accuracy by the
rule (before and after the run's steps), the mean rule reward and judge reward of the sampled
answers over all steps, then the judge's verdicts against the rule's over every sample both
scored (the `agreement/judge/*` counts summed over the steps): the share it agreed, Cohen's
kappa (agreement beyond what the two verdicts' rates give by chance; 0 = none), the share it
called correct against the share the rule did, and its answers that did not parse.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared benchmark helpers
from _common import markdown_table, records  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "judge_smollm2_cpu"
RUNS = ("judge", "rule")
CELLS = ("both", "head_only", "source_only", "neither")


def agreement(counts: dict[str, float]) -> dict[str, float]:
    """Agreement, Cohen's kappa and the two 'correct' rates from the 2x2 counts (head = the
    rule, source = the judge)."""
    n = sum(counts.values())
    rule = (counts["both"] + counts["head_only"]) / n
    judge = (counts["both"] + counts["source_only"]) / n
    agree = (counts["both"] + counts["neither"]) / n
    chance = rule * judge + (1 - rule) * (1 - judge)
    kappa = (agree - chance) / (1 - chance) if chance < 1 else 0.0
    return {"n": n, "agree": agree, "kappa": kappa, "rule_rate": rule, "judge_rate": judge}


def run_row(path: Path) -> dict:
    """One run's figures (see the module docstring)."""
    summary = json.loads((path / "summary.json").read_text())
    steps = [r for r in records(path / "metrics.jsonl") if "reward_mean" in r]
    counts = {c: sum(r.get(f"agreement/judge/{c}", 0.0) for r in steps) for c in CELLS}
    mean = lambda k: sum(r[k] for r in steps) / len(steps)  # noqa: E731
    return {"steps": len(steps), "before": summary["eval_accuracy_before"],
            "after": summary["eval_accuracy_after"], "rule_reward": mean("reward/rules"),
            "judge_reward": mean("reward/judge"),
            "parse_failures": sum(r.get("judge_parse_failures", 0.0) for r in steps),
            **agreement(counts)}


def table(results: Path = RESULTS) -> str:
    rows = []
    for name in RUNS:
        r = run_row(results / name)
        rows.append([name, r["steps"], f"{r['before']:.3f} -> {r['after']:.3f}",
                     f"{r['rule_reward']:.3f}", f"{r['judge_reward']:.3f}", int(r["n"]),
                     f"{r['agree']:.1%}", f"{r['kappa']:.2f}",
                     f"{r['judge_rate']:.1%} / {r['rule_rate']:.1%}", int(r["parse_failures"])])
    return markdown_table(
        ["rewarded by", "steps", "held-out accuracy (rule)", "rule reward", "judge reward",
         "samples judged", "judge agrees with rule", "Cohen's kappa",
         "called correct: judge / rule", "judge answers not parsed"], rows)


if __name__ == "__main__":
    print(table(Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS))
