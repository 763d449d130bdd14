"""What rollout.engine_failure=continue costs: the vLLM engine in a child process of its rollout
rank (`megagrpo.engine.process.EngineProcess`) against the same engine in the rank's own process
(`VLLMEngine`), per model size:

- `sync_s`: a full weight update (every HF tensor, float32, in 64 MiB buckets), median of
  --repeats; through the child the tensors cross a pipe via shared memory, in chunks;
- `generate_s`: 8 prompts x 4 samples x 16 new tokens, median of --repeats;
- `start_s`: the engine's start (the child's includes its interpreter and imports);
- `tokens_equal`: both engines, same seed and weights, sampled the same tokens (a check, not a
  figure).

Each size runs in a process of its own (the child first, then the engine in-process). Prints
one JSON line per size and appends it to --out; `--table FILE` prints the markdown table that
docs/resume.md holds.

    python benchmarks/engine_process.py --sizes tiny 10m 50m --repeats 3 \
        --out benchmarks/results/engine_process_cpu.jsonl
    python benchmarks/engine_process.py --table benchmarks/results/engine_process_cpu.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import MODEL_SIZES as SIZES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[1 + (7 * i + j) % 50 for j in range(6)] for i in range(8)]


def _weights(shapes: dict, seed: int) -> list[list]:
    import torch

    g = torch.Generator().manual_seed(seed)
    buckets, bucket, size = [], [], 0
    for name, shape in sorted(shapes.items()):
        t = torch.randn(*shape, generator=g) * 0.02
        bucket.append((name, t))
        size += t.numel() * 4
        if size >= 64 << 20:
            buckets.append(bucket)
            bucket, size = [], 0
    return buckets + ([bucket] if bucket else [])


def _measure(engine, shapes: dict, repeats: int) -> dict:
    weights = _weights(shapes, 0)
    engine.update_weights(iter(weights))  # warm-up, and the weights both sample with
    engine.generate(PROMPTS, n=4)
    syncs, gens = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.update_weights(iter(weights))
        syncs.append(time.perf_counter() - t0)
        engine.set_rng_state(state := engine.rng_state())
        t0 = time.perf_counter()
        out = engine.generate(PROMPTS, n=4)
        gens.append(time.perf_counter() - t0)
    engine.set_rng_state(state)
    tokens = [c.token_ids for c in engine.generate(PROMPTS, n=4)]
    return {"sync_s": statistics.median(syncs), "generate_s": statistics.median(gens),
            "tokens": tokens, "generated": sum(len(c.token_ids) for c in out)}


def run_one(size: str, repeats: int) -> dict:
    import torch

    from megagrpo.config.model import ModelConfig
    from megagrpo.config.rollout import RolloutConfig
    from megagrpo.engine import VLLMEngine
    from megagrpo.engine.process import EngineProcess
    from megagrpo.hf import hf_config_dict

    mcfg = ModelConfig(architecture="llama", max_position_embeddings=256, **SIZES[size])
    folder = Path(tempfile.mkdtemp(prefix="engine_process_"))
    (folder / "config.json").write_text(json.dumps(hf_config_dict(mcfg)))
    cfg = RolloutConfig(max_model_len=256, max_num_seqs=32, max_tokens=16, seed=3,
                        cpu_kvcache_space_gib=1)
    build = partial(VLLMEngine, cfg, folder, dtype="float32")
    t0 = time.perf_counter()
    child = EngineProcess(build, timeout_s=600, rank=0)
    child_start = time.perf_counter() - t0
    shapes = child._call("expected_params")
    apart = _measure(child, shapes, repeats)
    child.close()
    t0 = time.perf_counter()
    here = build()
    here_start = time.perf_counter() - t0
    inproc = _measure(here, shapes, repeats)
    nbytes = sum(4 * torch.Size(s).numel() for s in shapes.values())
    load = os.getloadavg()
    return {"size": size, "weight_bytes": nbytes, "repeats": repeats,
            "sync_s": round(inproc["sync_s"], 4), "sync_s_child": round(apart["sync_s"], 4),
            "sync_x": round(apart["sync_s"] / inproc["sync_s"], 2),
            "generate_s": round(inproc["generate_s"], 4),
            "generate_s_child": round(apart["generate_s"], 4),
            "generate_x": round(apart["generate_s"] / inproc["generate_s"], 2),
            "start_s": round(here_start, 1), "start_s_child": round(child_start, 1),
            "tokens_equal": inproc["tokens"] == apart["tokens"],
            "generated_tokens": inproc["generated"], "cpu": _cpu(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "load": [round(x, 1) for x in load]}


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return " ".join(line.split(":", 1)[1].split())
    return "unknown"


def table(path: str) -> str:
    rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    out = ["| size | weights | sync in-process | sync via child | x | generate in-process | "
           "generate via child | x | start (child) | same tokens |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['size']} | {r['weight_bytes'] / 2**20:.1f} MiB | {r['sync_s']:.3f} s "
                   f"| {r['sync_s_child']:.3f} s | {r['sync_x']:.2f} | {r['generate_s']:.3f} s "
                   f"| {r['generate_s_child']:.3f} s | {r['generate_x']:.2f} | "
                   f"{r['start_s']:.1f} s ({r['start_s_child']:.1f} s) | "
                   f"{'yes' if r['tokens_equal'] else 'NO'} |")
    cpus = sorted({f"{r['cpu']} ({r['cpu_capability']})" for r in rows})
    loads = sorted({r["load"][0] for r in rows})
    out.append("")
    out.append(f"{', '.join(cpus)}; load average {loads[0]}-{loads[-1]}; median of "
               f"{rows[0]['repeats']} repeats; 8 prompts x 4 samples x 16 tokens.")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="*", default=["tiny", "10m", "50m"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--table")
    args = ap.parse_args()
    if args.table:
        print(table(args.table))
        return
    if args.one:
        print(json.dumps(run_one(args.one, args.repeats)), flush=True)
        return
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_ENABLE_V1_MULTIPROCESSING="0")
    for size in args.sizes:
        p = subprocess.run([sys.executable, __file__, "--one", size, "--repeats",
                            str(args.repeats)], env=env, capture_output=True, text=True)
        if p.returncode:
            sys.exit(f"{size} failed:\n{p.stderr[-4000:]}")
        line = [x for x in p.stdout.splitlines() if x.startswith("{")][-1]
        print(line, flush=True)
        if args.out:
            with args.out.open("a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
