"""The README's demo table: `make demo`'s recipe (examples/demo.yaml) run with run.seed 1, 2, 3,
from the kept runs in benchmarks/results/demo_seeds_cpu/ (`seedN-target-epyc-*`).

    .venv/bin/python benchmarks/demo_seeds_report.py [benchmarks/results/demo_seeds_cpu]

Per seed: the cold start's steps and the held-out accuracy it stopped at, the GRPO steps run
(the recipe stops at eval.target_accuracy, run.steps is the cap), the final held-out accuracy,
the command's wall time with the load average it ran under (sampled every 20 s; a loaded
machine's wall time is not a quiet one), and an estimate of the quiet wall time: these steps at
the rates of the earlier quiet runs of the same machine (`seedN-quiet-epyc-summary.json`:
start-up, cold-start and GRPO seconds per step). tests/test_eval_target.py checks the README
holds exactly this table.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "demo_seeds_cpu"


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def quiet_rates(results: Path = RESULTS) -> tuple[float, float]:
    """Seconds per cold-start step and per GRPO step of the earlier quiet runs (means over their
    seeds; a GRPO step's share holds the run's start-up and evaluations too). Their runs'
    own wall time: the launcher's start before torchrun (~20 s) is not in it."""
    runs = [_load(p) for p in sorted(results.glob("seed*-quiet-epyc-summary.json"))]
    if not runs:
        raise FileNotFoundError(f"no seed*-quiet-epyc-summary.json in {results}")
    sft = sum(r["sft_seconds"] / r["sft_steps"] for r in runs) / len(runs)
    grpo = sum((r["wall_seconds"] - r["sft_seconds"]) / r["steps"] for r in runs) / len(runs)
    return sft, grpo


def rows(results: Path = RESULTS) -> list[dict]:
    """One dict per kept seed run of the current recipe, by seed."""
    out = []
    for p in sorted(results.glob("seed*-target-epyc-summary.json")):
        seed = p.name.split("-", 1)[0].removeprefix("seed")
        s, run = _load(p), _load(results / f"seed{seed}-target-epyc-run.json")
        out.append({"seed": int(seed), "summary": s, "run": run})
    return sorted(out, key=lambda r: r["seed"])


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(round(seconds % 60)):02d} s"


def table(results: Path = RESULTS) -> str:
    """The markdown table (header, separator, one row per seed, the spread)."""
    sft_rate, grpo_rate = quiet_rates(results)
    lines = ["| run.seed | cold start: steps -> held-out | GRPO steps (stop at target) | "
             "held-out after GRPO | wall time, whole command (load average) | "
             "quiet estimate |", "|---|---|---|---|---|---|"]
    finals = []
    for r in rows(results):
        s, run = r["summary"], r["run"]
        finals.append(s["eval_accuracy_after"])
        target = s.get("eval_target_step")
        stop = (f"{s['steps']} (reached {s['eval_target_accuracy']:g})" if target is not None
                else f"{s['steps']} (cap; {s['eval_target_accuracy']:g} not reached)")
        quiet = s["sft_steps"] * sft_rate + s["steps"] * grpo_rate
        lines.append(
            f"| {r['seed']} | {s['sft_steps']} -> {s['sft_eval_accuracy']:.3f} | {stop} | "
            f"{s['eval_accuracy_after']:.3f} | {_minutes(run['wall_seconds_command'])} "
            f"({run['load_mean']:.0f}) | ~{_minutes(quiet)} |")
    if finals:
        lines.append(f"| spread | | | {min(finals):.3f} - {max(finals):.3f} | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS))
