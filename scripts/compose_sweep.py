"""The composition sweep: does each pair of capabilities (and the triples users run together)
train, or is it refused before any process starts? Issue 50.

Each combination is a real `python -m megagrpo train` on a tiny random Qwen3 (or Qwen3-MoE when
a feature needs experts) with the demo's arithmetic task, 2 GRPO steps, colocated unless the
combination says otherwise. A combination

- **runs** when it exits 0, every metric it logged is finite, and the vLLM-vs-trainer log-prob
  gap on fresh samples (policy lag 0) is within the dtype's rounding (fp32 1e-3, bf16 5e-2);
- is **refused** when it exits 2 with a one-line error naming the fields and no traceback,
  before a run folder exists;
- **fails** otherwise (a traceback, a gap, a hang past the timeout): a failure of the sweep.

Results are appended to a JSON-lines file (one row per combination, the CPU named), which
`--table` turns into docs/composition.md; a row already in the file is not run again.

    python scripts/compose_sweep.py                     # every pair with a core feature + triples
    python scripts/compose_sweep.py --only lora+sp lora+moe+sp
    python scripts/compose_sweep.py --table             # regenerate docs/composition.md
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "compose_cpu.jsonl"
TABLE = ROOT / "docs" / "composition.md"
DEMO = ROOT / "examples" / "demo.yaml"
MAX_RANKS = 4
"""Combinations that need more ranks are listed as not swept (2 cores)."""


@dataclasses.dataclass(frozen=True)
class Feature:
    overrides: tuple[str, ...]
    """CLI overrides that turn it on."""
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    moe: bool = False
    """Needs a mixture-of-experts model."""
    rollout_ranks: int = 0
    """Ranks of its own for rollouts (separate placement)."""
    vllm_tp: int = 1


FEATURES: dict[str, Feature] = {
    "lora": Feature(("lora.rank=8", "lora.targets=[qkv, proj]")),
    "agent": Feature(("agent.environment=tests._agent_env:Digits", "agent.max_turns=3")),
    "async1": Feature(("rollout.max_staleness=1",)),
    "async2": Feature(("rollout.max_staleness=2",)),
    "partial": Feature(("rollout.max_staleness=1", "rollout.partial_rollouts=true")),
    "moe": Feature((), moe=True),
    "separate": Feature(("rollout.placement=separate", "rollout.rollout_ranks=1"),
                        rollout_ranks=1),
    "failover": Feature(("rollout.placement=separate", "rollout.rollout_ranks=2",
                         "rollout.engine_failure=continue"), rollout_ranks=2),
    "tp2": Feature(("parallel.tp=2", "parallel.sequence_parallel=false"), tp=2),
    "sp": Feature(("parallel.tp=2", "parallel.sequence_parallel=true"), tp=2),
    "pp2": Feature(("parallel.pp=2",), pp=2),
    "cp2": Feature(("parallel.cp=2",), cp=2),
    "ep2": Feature(("parallel.ep=2",), ep=2, moe=True),
    "replay": Feature(("algo.routing_replay=true",), moe=True),
    "distopt": Feature(("optim.distributed_optimizer=true",)),
    "bf16": Feature(("model.dtype=bfloat16", "rollout.dtype=bfloat16")),
    "dynsamp": Feature(("algo.dynamic_sampling=true",)),
    "gspo": Feature(("algo.loss_agg=gspo",)),
    "sapo": Feature(("algo.policy_loss=sapo",)),
    "compile": Feature(("compute.compile_layers=true",)),
    "vllm_tp2": Feature(("rollout.tensor_parallel_size=2",), vllm_tp=2),
    "rm": Feature(("reward.sources=[{source: rules, correctness: true}, {source: reward_model, "
                   "weight: 0.1, options: {path: '@RM@', template: '{prompt}{completion}', "
                   "prompt_field: ''}}]",)),
}
"""`rm`: a tiny random reward model (tests/support/tiny.py) beside the rule reward; `@RM@` is
its folder."""
CORE = ("lora", "agent", "async1", "moe", "separate")
"""What users run together (agentic + async/separate + LoRA + MoE): every pair with one of
these is swept."""
TRIPLES = (("agent", "async1", "lora"), ("moe", "lora", "async1"), ("moe", "lora", "sp"),
           ("separate", "agent", "lora"), ("separate", "moe", "lora"),
           ("separate", "async1", "lora"), ("separate", "async1", "replay"),
           ("separate", "tp2", "vllm_tp2"), ("separate", "async1", "vllm_tp2"),
           ("separate", "dynsamp", "vllm_tp2"), ("separate", "lora", "vllm_tp2"),
           ("separate", "agent", "vllm_tp2"), ("failover", "agent", "lora"),
           ("failover", "moe", "lora"), ("separate", "agent", "partial"))
EXCLUSIVE = ({"async1", "async2"}, {"async1", "partial"}, {"async2", "partial"}, {"tp2", "sp"},
             {"separate", "failover"})
"""Variants of one setting: never paired with each other."""
COMMON = ("run.steps=2", "data.batch_size=4", "algo.group_size=4", "algo.num_minibatches=1",
          "reference.sync_every_steps=1", "cold_start.steps=0", "eval.every=0",
          "log.tensorboard=false", "log.progress=false", "compute.micro_batch_size=16",
          "reward.terms=[{name: arithmetic}, {name: 'tests._rewards:length_reward', "
          "weight: 0.01}]")
GAP = {"float32": 1e-3, "bfloat16": 5e-2}


def combos(names: list[str] | None = None) -> list[tuple[str, ...]]:
    """The combinations to sweep: `names` ('a+b'), or every pair with a core feature, then the
    triples."""
    if names:
        return [tuple(n.split("+")) for n in names]
    pairs = [p for p in itertools.combinations(FEATURES, 2)
             if set(p) & set(CORE) and set(p) not in EXCLUSIVE]
    return pairs + list(TRIPLES)


def key(combo: tuple[str, ...]) -> str:
    return "+".join(sorted(combo))


def layout(combo: tuple[str, ...]) -> dict:
    """Ranks and model of a combination: training ranks tp x pp x cp x dp (dp 2 when nothing
    else splits the model or when experts go over 2 EP ranks), plus rollout ranks."""
    fs = [FEATURES[n] for n in combo]
    tp, pp, cp = (max(getattr(f, a) for f in fs) for a in ("tp", "pp", "cp"))
    ep = max(f.ep for f in fs)
    dp = max(ep, 1 if tp * pp * cp > 1 else 2)
    return {"nproc": tp * pp * cp * dp + rollout_ranks(combo),
            "moe": any(f.moe for f in fs),
            "dtype": "bfloat16" if "bf16" in combo else "float32"}


def models(cache: Path) -> dict[bool, Path]:
    """Tiny random Qwen3 and Qwen3-MoE checkpoints (vocab 100: the demo's characters fit)."""
    sys.path.insert(0, str(ROOT))
    from tests.support.tiny import tiny_qwen3, tiny_qwen3_moe

    out = {False: cache / "qwen3", True: cache / "qwen3_moe"}
    for moe, path in out.items():
        if not (path / "config.json").exists():
            (tiny_qwen3_moe if moe else tiny_qwen3)(path)
    return out


def reward_model(cache: Path) -> Path:
    """The `rm` feature's tiny random reward model, written once."""
    sys.path.insert(0, str(ROOT))
    from tests.support.tiny import tiny_reward_model

    path = cache / "reward_model"
    if not (path / "config.json").exists():
        tiny_reward_model(path, arch="llama")
    return path


def rollout_ranks(combo: tuple[str, ...]) -> int:
    """Rollout ranks of a combination: one engine's worth (separate placement forms engines
    of rollout.tensor_parallel_size rollout ranks)."""
    fs = [FEATURES[n] for n in combo]
    return sum(f.rollout_ranks for f in fs) * max(f.vllm_tp for f in fs)


def train_args(combo: tuple[str, ...], model: Path, out: Path) -> list[str]:
    """`megagrpo` arguments of one combination's run."""
    over = [o.replace("@RM@", str(reward_model(model.parent))) for n in combo
            for o in FEATURES[n].overrides]
    if rollout_ranks(combo) > sum(FEATURES[n].rollout_ranks for n in combo):
        over.append(f"rollout.rollout_ranks={rollout_ranks(combo)}")
    return ["train", "--config", str(DEMO), "--nproc", str(layout(combo)["nproc"]),
            f"run.init={model}", f"run.out_dir={out}", "run.overwrite=true", *COMMON, *over]


def run_one(combo: tuple[str, ...], model: Path, work: Path, timeout: float) -> dict:
    lay = layout(combo)
    row = {"combo": key(combo), "nproc": lay["nproc"], "model": model.name}
    if lay["nproc"] > MAX_RANKS:
        return {**row, "status": "not swept", "reason": f"needs {lay['nproc']} ranks"}
    out = work / key(combo)
    cmd = [sys.executable, "-m", "megagrpo", *train_args(combo, model, out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                           cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {**row, "status": "failed", "reason": f"timeout after {timeout:.0f} s"}
    row["seconds"] = round(time.time() - t0, 1)
    return {**row, **judge(p.returncode, p.stdout, p.stderr, out, lay["dtype"])}


def judge(rc: int, stdout: str, stderr: str, out: Path, dtype: str) -> dict:
    """runs / refused / failed, from what the command left (see the module docstring)."""
    lines = [x for x in stderr.strip().splitlines() if x.strip()]
    if rc == 2 and "Traceback" not in stderr and not (out / "metrics.jsonl").exists():
        reason = lines[-1].split("error: ", 1)[-1] if lines else ""
        return {"status": "refused", "reason": reason}
    if rc != 0:
        tail = [x for x in lines if "Error" in x][-1:] or lines[-1:]
        return {"status": "failed", "reason": f"rc={rc}: {tail[0][:300] if tail else ''}"}
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "logp_gap_vllm_mean" in r]
    bad = sorted({k for r in recs for k, v in r.items()
                  if isinstance(v, float) and not math.isfinite(v)})
    fresh = [r["logp_gap_vllm_mean"] for r in steps if r.get("policy_lag", 0) == 0] or \
        [r["logp_gap_vllm_mean"] for r in steps[:1]]
    gap = max(fresh) if fresh else float("nan")
    row = {"steps": len(steps), "gap": gap}
    if not steps or bad or not gap <= GAP[dtype]:
        why = (f"non-finite {bad}" if bad else f"vLLM gap {gap:.2g} > {GAP[dtype]:g}"
               if steps else "no GRPO step logged")
        return {**row, "status": "failed", "reason": why}
    return {**row, "status": "runs", "reason": ""}


def cpu_name() -> str:
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def read_rows(path: Path = RESULTS) -> dict[str, dict]:
    """The newest row of each combination."""
    if not path.exists():
        return {}
    return {r["combo"]: r for r in map(json.loads, path.read_text().splitlines())}


def table(rows: dict[str, dict]) -> str:
    """docs/composition.md: one line per combination, grouped by outcome."""
    order = {"failed": 0, "refused": 1, "runs": 2, "not swept": 3}
    n = {s: sum(r["status"] == s for r in rows.values()) for s in order}
    cpus = sorted({r.get("cpu", "?") for r in rows.values() if "cpu" in r})
    out = ["# What composes with what", "",
           "Generated by `python scripts/compose_sweep.py --table` from "
           "`benchmarks/results/compose_cpu.jsonl` (do not edit). Each combination is a real "
           "2-step `megagrpo train` on a tiny Qwen3 / Qwen3-MoE (`scripts/compose_sweep.py` "
           "says exactly what runs, is refused or fails). CPU: " + "; ".join(cpus) + ".", "",
           f"{n['runs']} run, {n['refused']} refused before compute, {n['failed']} failed, "
           f"{n['not swept']} not swept.", "",
           "| combination | ranks | outcome | vLLM gap (fresh) | why / what to do instead |",
           "|---|---|---|---|---|"]
    for r in sorted(rows.values(), key=lambda r: (order[r["status"]], r["combo"])):
        gap = f"{r['gap']:.1e}" if isinstance(r.get("gap"), float) else ""
        reason = r.get("reason", "").replace("|", "\\|")
        out.append(f"| {r['combo'].replace('+', ' + ')} | {r.get('nproc', '')} | "
                   f"{r['status']} | {gap} | {reason} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="combinations as a+b[+c]")
    ap.add_argument("--table", action="store_true", help="only regenerate the docs table")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--work", type=Path, default=ROOT / "benchmarks" / ".cache" / "compose")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--again", action="store_true", help="rerun combinations already in file")
    args = ap.parse_args(argv)
    if args.table:
        TABLE.write_text(table(read_rows(args.results)))
        return 0
    unknown = sorted({n for c in combos(args.only) for n in c} - set(FEATURES))
    if unknown:
        ap.error(f"--only: unknown features {unknown}; known: {', '.join(FEATURES)}")
    done = read_rows(args.results)
    mdl = models(args.work)
    failed = 0
    for combo in combos(args.only):
        if key(combo) in done and not args.again:
            continue
        row = {**run_one(combo, mdl[layout(combo)["moe"]], args.work, args.timeout),
               "cpu": cpu_name(), "date": time.strftime("%Y-%m-%d")}
        failed += row["status"] == "failed"
        print(f"{row['combo']:28s} {row['status']:9s} {row.get('seconds', '')!s:>6} "
              f"{row['reason'][:110]}", flush=True)
        args.results.parent.mkdir(parents=True, exist_ok=True)
        with open(args.results, "a") as f:
            f.write(json.dumps(row) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
