"""The demo's tables: `make demo`'s recipe (examples/demo.yaml) run with run.seed 1, 2, 3, from
the kept runs in benchmarks/results/demo_seeds_cpu/ (`seedN-TAG-{summary.json,run.json}`; TAG
names the CPU and the conditions, `TAGS` lists the ones docs/performance.md shows).

    .venv/bin/python benchmarks/demo_seeds_report.py [--summary] [benchmarks/results/demo_seeds_cpu]

Per CPU and seed: the cold start's steps and the held-out accuracy it stopped at, the GRPO steps
run (the recipe stops at eval.target_accuracy, run.steps is the cap), the final held-out
accuracy, the whole command's wall time with the mean 1-minute load it ran under (sampled every
20 s; the demo's own 2 ranks hold it near 3, so a mean near 3 is a run alone and a higher one a
shared machine), then the spread of the final accuracies and of the wall times.

`--summary`: the README's short table, one line per CPU kind (`KINDS`) over each seed's newest
run of today's recipe and code on it: held-out accuracy at the start, after the cold start and
after GRPO, the steps of both phases, the wall time.
tests/test_demo_seeds_report.py checks the README and docs/performance.md hold exactly these tables.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Callable
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

KINDS = {"AMD EPYC (family 25), AVX-512 + avx512_bf16, 2 cores":
         ("compiled-epyc25-balanced", "compiled-epyc25")}
"""CPU kind -> the tags of its runs with today's recipe and code, alone on the machine, newest
first (the summary takes each seed's run from the first tag that has it)."""


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


def newest_runs(results: Path, tags: tuple[str, ...]) -> list[dict]:
    """Each seed's run from the first of `tags` that holds it, by seed."""
    by_seed: dict[int, dict] = {}
    for tag in tags:
        for r in rows(results, tag):
            by_seed.setdefault(r["seed"], r)
    return [by_seed[seed] for seed in sorted(by_seed)]


def _accuracy(value: float) -> str:
    return f"{value:.3f}"


def _span(values: list[float], fmt: Callable[[float], str] = _accuracy, sep: str = "-") -> str:
    """'lo-hi' of `values` as `fmt` writes them, one figure where both read the same."""
    lo, hi = fmt(min(values)), fmt(max(values))
    return lo if lo == hi else f"{lo}{sep}{hi}"


def summary(results: Path = RESULTS, kinds: dict[str, tuple[str, ...]] = KINDS) -> str:
    """The README's table: one line per CPU kind with runs, spans over its seeds' newest runs."""
    lines = ["| CPU | run.seed | held-out accuracy: start -> cold start -> GRPO | steps: cold "
             "start + GRPO | wall time, whole command |",
             "|---|---|---|---|---|"]
    for cpu, tags in kinds.items():
        runs = newest_runs(results, tags)
        if not runs:
            continue
        s = [r["summary"] for r in runs]
        target = s[0]["eval_target_accuracy"]
        reached = sum(x.get("eval_target_step") is not None for x in s)
        acc = " -> ".join(_span([x[k] for x in s]) for k in (
            "eval_accuracy_init", "sft_eval_accuracy", "eval_accuracy_after"))
        steps = (f"{_span([x['sft_steps'] for x in s], str)} + "
                 f"{_span([x['steps'] for x in s], str)} ({reached} of {len(s)} reached "
                 f"{target:g})")
        wall = _span([r["run"]["wall_seconds_command"] for r in runs], _minutes, " - ")
        lines.append(f"| {cpu} | {', '.join(str(r['seed']) for r in runs)} | {acc} | {steps} | "
                     f"{wall} |")
    return "\n".join(lines)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--summary"]
    results = Path(args[0]) if args else RESULTS
    print(summary(results) if "--summary" in sys.argv[1:] else table(results))
