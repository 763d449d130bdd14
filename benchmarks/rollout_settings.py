"""vLLM CPU engine settings against one workload's rollout: which ones move decode speed.

    .venv/bin/python benchmarks/rollout_settings.py [--workload midsize] [--rollouts 3]
        [--variants default,seqs32,...] [--out benchmarks/results/rollout_settings_cpu.jsonl]
    .venv/bin/python benchmarks/rollout_settings.py --table PATH

Each variant runs in its own process (one fresh engine each: the settings are start-up ones)
on the workload's seeded init (`_workloads.ensure_init`, loaded into the engine with
`update_weights`), its first batch_size training prompts x G, its max_tokens and temperature,
EOS as the stop token; after one warm-up rollout, --rollouts timed ones. A variant is the
workload's rollout config with a few overrides (VARIANTS): max_num_seqs (how many sequences
decode together), max_num_batched_tokens (a small budget chunks the prefill), the KV cache
size, and VLLM_CPU_OMP_THREADS_BIND (vLLM's OpenMP thread pinning: 'auto' unset, 'nobind', or
a core list). One JSON line per variant: the best and median rollout seconds, completion tokens
per second of the best, and the bandwidth-aware floor (benchmarks/rollout_floor.py) of the
best rollout with its fraction. `default` runs first and last: the spread of the two is the
machine's noise, the bar a setting must clear.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _workloads as W  # noqa: E402
from _common import markdown_table, parser, print_table, records, write_lines  # noqa: E402
import rollout_floor as RF  # noqa: E402

VARIANTS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "default": ((), {}),
    "seqs32": (("rollout.max_num_seqs=32",), {}),
    "seqs64": (("rollout.max_num_seqs=64",), {}),
    "chunked256": (("rollout.max_num_batched_tokens=256",), {}),
    "kv4gib": (("rollout.cpu_kvcache_space_gib=4",), {}),
    "nobind": ((), {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}),
    "bind0-1": ((), {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}),
}
"""name -> (config overrides, environment) on top of the workload."""


def _read_safetensors(path: Path):
    from safetensors import safe_open

    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def run_variant(workload: str, variant: str, rollouts: int) -> dict:
    """One variant in this process (module docstring); its JSON record."""
    import torch

    from megagrpo.engine import SamplingSettings, VLLMEngine
    from megagrpo.runtime.machine import gemm_gflops, memory_read_gbs
    from megagrpo.tasks import build_task

    w = W.get_workload(workload)
    cfg = W.base_config(w, "float32", VARIANTS[variant][0])
    init = W.ensure_init(w, "float32")
    task = build_task(cfg.data, cfg.arithmetic)
    tok = task.tokenizer
    prompts = [tok.encode(e.prompt) for e in task.train[:cfg.data.batch_size]]
    engine = VLLMEngine(cfg.rollout, init, dtype="float32")
    engine.update_weights(_read_safetensors(Path(init)))
    settings = SamplingSettings(temperature=cfg.rollout.temperature,
                                max_tokens=cfg.rollout.max_tokens, n=cfg.algo.group_size,
                                stop_token_ids=(tok.eos_id,))
    engine.generate(prompts, settings)  # warm-up: the sampler's first compile
    runs = []
    for _ in range(rollouts):
        t0 = time.perf_counter()
        comps = engine.generate(prompts, settings)
        runs.append((time.perf_counter() - t0, comps))
    seconds, comps = min(runs, key=lambda r: r[0])
    per_prompt: list[list[int]] = [[] for _ in prompts]
    for c in comps:
        per_prompt[c.prompt_index].append(len(c.token_ids))
    threads = torch.get_num_threads()
    gflops, _ = gemm_gflops("float32", threads)
    gbs, _ = memory_read_gbs(threads)
    costs = RF.rollout_costs(cfg.model, 4, [len(p) for p in prompts], per_prompt)
    floor = RF.rollout_floor([costs], gflops, gbs)
    gen = sum(len(c.token_ids) for c in comps)
    return dict(workload=workload, variant=variant, overrides=list(VARIANTS[variant][0]),
                env=VARIANTS[variant][1], rollouts=rollouts,
                best_s=round(seconds, 4),
                median_s=round(statistics.median(r[0] for r in runs), 4),
                gen_tokens=gen, gen_tokens_per_s=round(gen / seconds, 1),
                floor_s=round(floor["floor_s"], 4), floor_frac=round(floor["floor_s"] / seconds, 4),
                bandwidth_bound_steps=floor["bandwidth_bound_steps"], decode_steps=floor["steps"],
                gemm_gflops=round(gflops, 1), mem_read_gbs=round(gbs, 2), threads=threads,
                loadavg_1m=round(os.getloadavg()[0], 2))


def table(path: str) -> str:
    """The markdown table of a results file: one row per variant, in file order."""
    rows = []
    for r in records(path):
        if "variant" not in r:
            continue
        how = ", ".join([*r["overrides"], *(f"{k}={v}" for k, v in r["env"].items())])
        rows.append([r["variant"], how or "the workload as is", f"{r['best_s']:.3f} s",
                     f"{r['median_s']:.3f} s", f"{r['gen_tokens_per_s']:.0f}",
                     f"{r['floor_frac']:.1%}",
                     f"{r['gemm_gflops']:.0f} GFLOP/s / {r['mem_read_gbs']:.0f} GB/s",
                     f"{r['loadavg_1m']:.2f}"])
    return markdown_table(["variant", "settings", "best rollout", "median", "completion tok/s",
                           "of the floor", "GEMM rate / bandwidth measured", "load"], rows)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--workload", default="midsize")
    ap.add_argument("--rollouts", type=int, default=3)
    ap.add_argument("--variants", default="default,seqs32,seqs64,chunked256,kv4gib,nobind,"
                                          "bind0-1,default")
    ap.add_argument("--out", default="benchmarks/results/rollout_settings_cpu.jsonl")
    ap.add_argument("--table", help="print the table of this results file and exit")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if print_table(args, table=table):
        return
    if args.one:
        print("RESULT " + json.dumps(run_variant(args.workload, args.one, args.rollouts)),
              flush=True)
        os._exit(0)  # skip vLLM's shutdown hooks
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; use some of {', '.join(VARIANTS)}")
    lines = []
    for v in args.variants.split(","):
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **VARIANTS[v][1]}
        proc = subprocess.run([sys.executable, __file__, "--workload", args.workload,
                               "--rollouts", str(args.rollouts), "--one", v],
                              env=env, capture_output=True, text=True)
        found = [ln[7:] for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not found:
            sys.exit(f"variant {v} failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
        lines.append(found[-1])
        print(found[-1], flush=True)
    if args.out:
        write_lines(args.out, lines)


if __name__ == "__main__":
    main()
