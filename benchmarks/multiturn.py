"""Multi-turn rollout throughput: model and environment tokens per second, tool time share and
turns per trajectory, beside a single-turn baseline, with synchronous and async rollouts.

Each (workload, mode) is a short real run (`python -m megagrpo train`, 2 ranks = DP 2, a tiny
Llama on the built-in arithmetic task, vLLM on CPU); its metrics.jsonl gives the figures, the
first step (start-up) left out. Workloads:

  single     agent off: one completion per prompt
  calc       `Budget` below with the built-in calculator (in process): each trajectory is given
             1-4 turns (from its prompt), every turn but the last answered with a tool result
  python     the same with the built-in python tool (a sandboxed child process per call)

A turn ends at EOS (the tiny model samples it within rollout.max_tokens ~90% of the time; a
turn cut there ends the trajectory, so turns per trajectory are measured, not assumed). Async:
run.async_rollout=true, the next batch drawn while the step trains.

    .venv/bin/python benchmarks/multiturn.py [--steps 5] [--workloads single,calc,python]
        [--modes sync,async] [--out benchmarks/results/multiturn_cpu/results.jsonl]
    .venv/bin/python benchmarks/multiturn.py --table benchmarks/results/multiturn_cpu/results.jsonl
        # docs/performance.md's table

Per step (means over the steps kept): `step_s` is the step's wall time (the sum of its
phases), `rollout_s` the time it spent on rollouts (sync: sampling; async: waiting for the
batch drawn on the side thread, the part the update did not hide). Model tokens are the
sampled ones, environment tokens the observations' (masked out of the loss); tokens/s are per
step wall time over both ranks. Tool share: tool seconds of one rank's trajectories over the
step's wall time.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from megagrpo.agent import Environment, Observation, Turn
from megagrpo.runtime.machine import cpu_name

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared benchmark helpers
from _common import run_train  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "multiturn_cpu" / "results.jsonl"
NPROC = 2
BATCH, GROUP = 8, 4  # prompts per step, samples per prompt: 32 trajectories a step
MODEL = ["model.vocab_size=19", "model.hidden_size=128", "model.ffn_hidden_size=256",
         "model.num_layers=2", "model.num_attention_heads=4", "model.num_query_groups=2",
         "model.head_dim=32", "model.max_position_embeddings=256",
         "parallel.make_vocab_size_divisible_by=16"]
WORKLOADS = {
    "single": [],
    "calc": ["agent.environment=benchmarks.multiturn:Budget", "agent.max_turns=4",
             "agent.kwargs={tool: calculator}"],
    "python": ["agent.environment=benchmarks.multiturn:Budget", "agent.max_turns=4",
               "agent.kwargs={tool: python}"],
}
MODES = {"sync": [], "async": ["run.async_rollout=true"]}


class Budget(Environment):
    """Gives its trajectory 1 + (a + b) % 4 turns (a, b: the arithmetic prompt's operands);
    answers every turn but the last with one call of `tool` ('calculator' or 'python') on the
    prompt's expression plus the turn index, as ' =<value> '."""

    def __init__(self, record: dict, tokenizer: object = None, tool: str = "calculator"):
        from megagrpo.agent.sandbox import Limits
        from megagrpo.agent.tools import load_tools

        super().__init__(record, tokenizer)
        self.turns = 1 + (int(record["a"]) + int(record["b"])) % 4
        self.tool = load_tools([tool], Limits())[0]
        self.expression = f"{record['a']} {record['op']} {record['b']}"

    def step(self, turn: Turn) -> Observation:
        if turn.index + 1 >= self.turns:
            return Observation(done=True)
        expr = f"{self.expression} + {turn.index}"
        args = {"expression": expr} if self.tool.name == "calculator" else \
            {"code": f"print({expr})"}
        result = self.tool.call(args)
        value = "".join(ch for ch in result.text if ch.isdigit() or ch == "-")
        return Observation(text=f" ={value} ", tool_calls=1, tool_errors=int(result.error),
                           tool_seconds=result.seconds)


def overrides(out_dir: Path, steps: int, workload: str, mode: str) -> list[str]:
    return [*MODEL, "optim.lr=1e-3", "rollout.max_tokens=48", "rollout.max_model_len=256",
            "rollout.cpu_kvcache_space_gib=1", f"algo.group_size={GROUP}",
            f"data.batch_size={BATCH}", "reward.terms=[{name: 'tests._rewards:length_reward'}]",
            "arithmetic.num_train=256", "arithmetic.num_eval=8", "compute.micro_batch_size=16",
            "compute.kernel_impl=torch", f"run.out_dir={out_dir}", f"run.steps={steps}",
            "run.overwrite=true", "checkpoint.every=0", "checkpoint.at_end=false",
            "log.tensorboard=false", *WORKLOADS[workload], *MODES[mode]]


def train(out_dir: Path, steps: int, workload: str, mode: str, nproc: int = NPROC) -> float:
    """Runs one configuration; returns its wall seconds. Raises with the log's tail on failure."""
    return run_train(overrides(out_dir, steps, workload, mode), nproc=nproc,
                     name=f"{workload}/{mode}", timeout=900)


def summarize(records: list[dict], dp: int, skip: int = 1) -> dict:
    """Per-step means of a run's GRPO step records (the first `skip` left out)."""
    steps = [r for r in records if "reward_mean" in r][skip:]
    if not steps:
        raise ValueError(f"no step records after the first {skip}")
    n = BATCH * GROUP  # trajectories per step, all ranks

    def mean(f) -> float:
        return sum(f(r) for r in steps) / len(steps)

    step_s = mean(lambda r: sum(v for k, v in r.items() if k.startswith("time_")))
    share = mean(lambda r: r.get("env_token_share", 0.0))
    traj = mean(lambda r: r.get("trajectory_len", r["completion_len"]))
    model = mean(lambda r: r["completion_len"])
    tool_s = mean(lambda r: r.get("tool_seconds", 0.0)) * n / dp  # one rank's trajectories
    return {"steps_kept": len(steps), "step_s": step_s,
            "rollout_s": mean(lambda r: r["time_rollout"] + r.get("time_rollout_wait", 0.0)),
            "turns": mean(lambda r: r.get("turns", 1.0)),
            "tool_calls": mean(lambda r: r.get("tool_calls", 0.0)),
            "model_tokens_per_traj": model, "env_tokens_per_traj": traj * share,
            "env_token_share": share, "model_tokens_per_s": model * n / step_s,
            "env_tokens_per_s": traj * share * n / step_s, "tool_s_per_step": tool_s,
            "tool_share": tool_s / step_s}


def measure(workload: str, mode: str, steps: int, nproc: int = NPROC) -> dict:
    """One run's record: the configuration, the machine and its load, the per-step figures."""
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="mg-multiturn-") as tmp:
        out = Path(tmp) / "run"
        wall = train(out, steps, workload, mode, nproc)
        records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {"workload": workload, "mode": mode, "steps": steps, "nproc": nproc,
            "trajectories_per_step": BATCH * GROUP, "cpu": cpu_name(),
            "cores": os.cpu_count(), "loadavg_1m_start": round(load0, 2),
            "loadavg_1m_end": round(os.getloadavg()[0], 2), "wall_s": round(wall, 1),
            **summarize(records, dp=nproc)}


def table(path: Path = RESULTS) -> str:
    """docs/performance.md's table (header, separator, one row per run)."""
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    lines = ["| workload | rollouts | turns / traj | tool calls / traj | model tok / traj | "
             "env tok / traj | step s | rollout s | model tok/s | env tok/s | tool share |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['mode']} | {r['turns']:.2f} | "
                     f"{r['tool_calls']:.2f} | {r['model_tokens_per_traj']:.1f} | "
                     f"{r['env_tokens_per_traj']:.1f} | {r['step_s']:.2f} | "
                     f"{r['rollout_s']:.2f} | {r['model_tokens_per_s']:.0f} | "
                     f"{r['env_tokens_per_s']:.0f} | {100 * r['tool_share']:.1f}% |")
    loads = [x for r in rows for x in (r["loadavg_1m_start"], r["loadavg_1m_end"])]
    lines.append("")
    lines.append(f"{rows[0]['cpu']}, {rows[0]['cores']} cores, {rows[0]['nproc']} ranks; "
                 f"1-minute load average {min(loads):.1f}-{max(loads):.1f} during the runs.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--workloads", default="single,calc,python")
    ap.add_argument("--modes", default="sync,async")
    ap.add_argument("--nproc", type=int, default=NPROC)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--table", nargs="?", const=str(RESULTS), default=None, metavar="JSONL",
                    help="print the markdown table of a results file and exit")
    args = ap.parse_args(argv)
    if args.table:
        print(table(Path(args.table)))
        return
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for workload in args.workloads.split(","):
        for mode in args.modes.split(","):
            line = json.dumps(measure(workload, mode, args.steps, args.nproc))
            print(line, flush=True)
            with open(args.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
