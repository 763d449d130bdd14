"""The README's demo table: `make demo`'s recipe (examples/demo.yaml) run with run.seed 1, 2, 3,
from the kept runs in benchmarks/results/demo_seeds_cpu/ (`seedN-TAG-{summary.json,run.json}`;
TAG names the CPU and the conditions, `TAGS` lists the ones the README shows).

    .venv/bin/python benchmarks/demo_seeds_report.py [benchmarks/results/demo_seeds_cpu]

Per CPU and seed: the cold start's steps and the held-out accuracy it stopped at, the GRPO steps
run (the recipe stops at eval.target_accuracy, run.steps is the cap), the final held-out
accuracy, the whole command's wall time with the mean 1-minute load it ran under (sampled every
20 s; the demo's own 2 ranks hold it near 3, so a mean near 3 is a run alone and a higher one a
shared machine), then the spread of the final accuracies and of the wall times.
tests/test_eval_target.py checks the README holds exactly this table.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "demo_seeds_cpu"


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


TAGS = {"compiled-epyc25-balanced": "AMD EPYC (family 25), AVX-512 + avx512_bf16, layers "
                                   "compiled, the current balancing exchange",
        "compiled-epyc25": "AMD EPYC (family 25), AVX-512 + avx512_bf16, layers compiled",
        "target-epyc25": "AMD EPYC (family 25), AVX-512 + avx512_bf16, eager (before auto)",
        "target-epyc": "AMD EPYC, AVX-512 + avx512_bf16 (3 seeds at once, beside other jobs)"}
"""Run tag -> the CPU (and conditions) the table names, newest first."""


def rows(results: Path = RESULTS, tag: str = "compiled-epyc25") -> list[dict]:
    """One dict per kept seed run of the current recipe with this tag, by seed."""
    out = []
    for p in sorted(results.glob(f"seed*-{tag}-summary.json")):
        seed = p.name.split("-", 1)[0].removeprefix("seed")
        s, run = _load(p), _load(results / f"seed{seed}-{tag}-run.json")
        out.append({"seed": int(seed), "summary": s, "run": run})
    return sorted(out, key=lambda r: r["seed"])


def _minutes(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)  # rounded first: 3599.6 s is 60 min 00 s, not 59 min 60 s
    return f"{m} min {s:02d} s"


def table(results: Path = RESULTS) -> str:
    """The markdown table (header, separator, one row per CPU and seed, a spread per CPU)."""
    lines = ["| CPU | run.seed | cold start: steps -> held-out | GRPO steps (stop at target) | "
             "held-out after GRPO | wall time, whole command (mean load) |",
             "|---|---|---|---|---|---|"]
    for tag, cpu in TAGS.items():
        finals, walls = [], []
        for r in rows(results, tag):
            s, run = r["summary"], r["run"]
            finals.append(s["eval_accuracy_after"])
            walls.append(run["wall_seconds_command"])
            target = s.get("eval_target_step")
            stop = (f"{s['steps']} (reached {s['eval_target_accuracy']:g})" if target is not None
                    else f"{s['steps']} (cap; {s['eval_target_accuracy']:g} not reached)")
            lines.append(
                f"| {cpu} | {r['seed']} | {s['sft_steps']} -> {s['sft_eval_accuracy']:.3f} | "
                f"{stop} | {s['eval_accuracy_after']:.3f} | "
                f"{_minutes(run['wall_seconds_command'])} ({run['load_mean']:.1f}) |")
        if len(finals) > 1:
            lines.append(f"| {cpu} | spread | | | {min(finals):.3f} - {max(finals):.3f} | "
                         f"{_minutes(min(walls))} - {_minutes(max(walls))} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS))
