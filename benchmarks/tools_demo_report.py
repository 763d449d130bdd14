"""docs/agentic.md's tool-demo table from a run of examples/tools-demo.yaml (its summary.json and
metrics.jsonl, kept in benchmarks/results/tools_demo_cpu/).

    .venv/bin/python benchmarks/tools_demo_report.py [benchmarks/results/tools_demo_cpu]

Rows: held-out greedy accuracy (initial weights, after the cold start, after GRPO), and over the
first and the last `WINDOW` GRPO steps the sampled trajectories' mean reward, well-formed tool
calls (tool_calls - tool_errors) and malformed calls per trajectory; then the steps and wall
time. tests/test_tool_task.py checks docs/agentic.md holds exactly this table.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "tools_demo_cpu"
WINDOW = 5


def _mean(rows: list[dict], key) -> float:
    return sum(key(r) for r in rows) / max(len(rows), 1)


def table(results: Path = RESULTS) -> str:
    """The markdown table (header, separator, rows)."""
    s = json.loads((results / "summary.json").read_text())
    steps = [r for r in map(json.loads, (results / "metrics.jsonl").read_text().splitlines())
             if "reward_mean" in r]
    first, last = steps[:WINDOW], steps[-WINDOW:]
    span = (f"steps 1-{first[-1]['step']} -> steps {last[0]['step']}-{last[-1]['step']}")
    lines = ["| measure | before | after |", "|---|---|---|",
             "| held-out accuracy (greedy): initial weights -> after the cold start | "
             f"{s['eval_accuracy_init']:.3f} | {s['eval_accuracy_before']:.3f} |",
             f"| held-out accuracy: before -> after {s['steps']} GRPO steps | "
             f"{s['eval_accuracy_before']:.3f} | {s['eval_accuracy_after']:.3f} |",
             f"| sampled trajectories ({span}): reward | "
             f"{_mean(first, lambda r: r['reward_mean']):.3f} | "
             f"{_mean(last, lambda r: r['reward_mean']):.3f} |",
             "| well-formed tool calls per trajectory | "
             f"{_mean(first, lambda r: r['tool_calls'] - r['tool_errors']):.3f} | "
             f"{_mean(last, lambda r: r['tool_calls'] - r['tool_errors']):.3f} |",
             "| malformed tool calls per trajectory | "
             f"{_mean(first, lambda r: r['tool_errors']):.3f} | "
             f"{_mean(last, lambda r: r['tool_errors']):.3f} |",
             f"| steps: cold start -> GRPO | {s['sft_steps']} | {s['steps']} |",
             f"| wall time of the run (minutes): cold start -> all | "
             f"{s['sft_seconds'] / 60:.1f} | {s['wall_seconds'] / 60:.1f} |"]
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS))
