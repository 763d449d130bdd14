"""The demo (examples/demo.yaml) in fp32, bf16 and fp16, the same seed, the same step budget:
held-out accuracy at the start, after the cold start and after GRPO, the vLLM-vs-trainer
log-prob gap, and the wall time; one JSON file per dtype in benchmarks/results/dtype_demo_cpu/.

    flock /tmp/megagrpo-heavy.lock .venv/bin/python benchmarks/dtype_demo.py \\
        [--dtypes float32,bfloat16,float16] [--steps 100] [--tag xeon]
    .venv/bin/python benchmarks/dtype_demo.py --table       # docs/performance.md's table

bf16 and fp16 runs use `model.dtype=D rollout.dtype=D algo.rollout_is=truncate` (the GPU
recipes' correction of the gap the narrow dtype opens); fp16 trains with megatron's dynamic
loss scaling (optim.loss_scale=0). `eval.target_accuracy=1.0` keeps every run to the same
`run.steps` budget (the recipe stops at 0.92). The load average is sampled every 20 s: the
machine is shared, and the demo's own 2 ranks hold it near 3 when alone.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

from _common import markdown_table, parser

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "dtype_demo_cpu"
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def cpu_name() -> str:
    import torch

    model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                  if ln.startswith("model name")), platform.processor())
    flags = open("/proc/cpuinfo").read()
    extra = [f for f in ("avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16") if f in flags]
    return (f"{model}, {torch.backends.cpu.get_cpu_capability()} + {' + '.join(extra)}, "
            f"{os.cpu_count()} cores")


def _sample_load(samples: list[float], stop: threading.Event) -> None:
    while not stop.wait(20.0):
        samples.append(os.getloadavg()[0])


def overrides(dtype: str, steps: int, seed: int, out: Path) -> list[str]:
    narrow = [] if dtype == "float32" else [f"model.dtype={dtype}", f"rollout.dtype={dtype}",
                                            "algo.rollout_is=truncate"]
    return [*narrow, f"run.steps={steps}", "eval.target_accuracy=1.0", f"run.seed={seed}",
            f"run.out_dir={out}"]


def run_one(dtype: str, steps: int, seed: int, tag: str, timeout: int) -> dict:
    out = Path(f"/tmp/dtype_demo_{os.getpid()}") / dtype
    cmd = [sys.executable, "-m", "megagrpo", "demo", *overrides(dtype, steps, seed, out)]
    loads, stop = [os.getloadavg()[0]], threading.Event()
    sampler = threading.Thread(target=_sample_load, args=(loads, stop), daemon=True)
    sampler.start()
    t0, start = time.monotonic(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        rc, tail = p.returncode, (p.stdout + p.stderr)[-3000:]
    except subprocess.TimeoutExpired as e:
        rc, tail = "timeout", str(e.stdout or "")[-3000:]
    wall = time.monotonic() - t0
    stop.set()
    rec = {"dtype": dtype, "tag": tag, "cpu": cpu_name(), "seed": seed, "steps_budget": steps,
           "command": "python -m megagrpo demo " + " ".join(overrides(dtype, steps, seed,
                                                                      Path("OUT"))),
           "start_utc": start, "rc": rc, "wall_seconds_command": wall,
           "load_mean": sum(loads) / len(loads), "load_max": max(loads),
           "load_samples": len(loads)}
    metrics = out / "metrics.jsonl"
    if metrics.exists():
        rec.update(summarize([json.loads(ln) for ln in metrics.read_text().splitlines()]))
    summary = out / "summary.json"
    if summary.exists():
        rec["summary"] = json.loads(summary.read_text())
    if rc != 0:
        rec["tail"] = tail
    return rec


def summarize(records: list[dict]) -> dict:
    """From a run's metrics.jsonl: GRPO steps run, held-out accuracy per evaluation, the mean
    and max over steps of logp_gap_vllm_mean, the mean loss scale and overflow-skipped steps
    (fp16), the mean reward over the first and last 10 steps."""
    steps = [r for r in records if "reward_mean" in r]
    evals = {r["step"]: r["eval_accuracy"] for r in records if "eval_accuracy" in r}
    gaps = [r["logp_gap_vllm_mean"] for r in steps if "logp_gap_vllm_mean" in r]
    out = {"grpo_steps": len(steps), "evals": evals,
           "gap_mean": sum(gaps) / max(len(gaps), 1), "gap_max": max(gaps, default=0.0),
           "reward_first10": _mean([r["reward_mean"] for r in steps[:10]]),
           "reward_last10": _mean([r["reward_mean"] for r in steps[-10:]]),
           "update_skipped": sum(r.get("update_skipped", 0.0) for r in steps),
           "loss_scale_overflows": sum(r.get("loss_scale_overflows", 0.0) for r in steps)}
    scales = [r["loss_scale"] for r in steps if "loss_scale" in r]
    if scales:
        out["loss_scale_last"] = scales[-1]
        out["loss_scale_min"] = min(scales)
    return out


def _mean(xs: list[float]) -> float:
    return sum(xs) / max(len(xs), 1)


def _minutes(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s:02d} s"


def table(results: Path = RESULTS) -> str:
    """docs/performance.md's table: one row per kept run (file), fp32 / bf16 / fp16 order."""
    order = list(SHORT)
    runs = [json.loads(p.read_text()) for p in sorted(results.glob("*.json"))]
    runs.sort(key=lambda r: (r["tag"], order.index(r["dtype"])))
    rows = []
    for r in runs:
        s = r.get("summary", {})
        ev = r.get("evals", {})
        last = max(ev, key=int) if ev else None
        acc = (f"{s.get('eval_accuracy_init', float('nan')):.3f} -> "
               f"{s.get('eval_accuracy_before', float('nan')):.3f} -> "
               + (f"{ev[last]:.3f} (step {last})" if last is not None else "n/a"))
        scale = (f"{r['loss_scale_overflows']:.0f}, {r['loss_scale_last']:.0f}"
                 if "loss_scale_last" in r else "-")
        done = "" if r["rc"] == 0 else f" (rc {r['rc']})"
        rows.append([r["cpu"], SHORT[r["dtype"]], acc, f"{r.get('grpo_steps', 0)}{done}",
                     f"{r.get('reward_first10', 0):.3f} / {r.get('reward_last10', 0):.3f}",
                     f"{r.get('gap_mean', 0):.2g} ({r.get('gap_max', 0):.2g})", scale,
                     f"{_minutes(r['wall_seconds_command'])} ({r['load_mean']:.1f})"])
    return markdown_table(
        ["CPU", "dtype", "held-out: start -> cold start -> GRPO step N", "GRPO steps",
         "reward, first / last 10 steps", "vLLM-vs-trainer gap, mean (max)",
         "fp16 overflow skips, last scale", "wall time (mean load)"], rows)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--dtypes", default="float32,bfloat16,float16")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tag", default="xeon")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--table", action="store_true", help="print the table of the kept runs")
    args = ap.parse_args()
    if args.table:
        print(table())
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    for dtype in args.dtypes.split(","):
        rec = run_one(dtype, args.steps, args.seed, args.tag, args.timeout)
        (RESULTS / f"{args.tag}-{SHORT[dtype]}.json").write_text(json.dumps(rec, indent=1))
        print(json.dumps({k: v for k, v in rec.items() if k != "tail"}), flush=True)
        if "tail" in rec:
            print(rec["tail"], flush=True)


if __name__ == "__main__":
    main()
