"""Reference re-initialisation: megagrpo's in-place sync vs reloading an HF export from disk.

    .venv/bin/python benchmarks/reference_sync.py [--sizes tiny,10m,50m,100m] [--tps 1,2]
        [--repeats 5] [--out benchmarks/results/reference_sync_cpu.jsonl]

One JSON line per (size, TP). Each runs in its own process (TP=1) or torchrun group (TP=2), on
a megatron policy / reference pair of the same layout (fp32, CPU):
  inplace_a1_s     megagrpo.model.reference.sync_reference(ref, policy, 1.0): copy_ per shard
  inplace_a05_s    the same with alpha=0.5: lerp_ per shard
  reload_s         the alternative: export_hf(policy) writes safetensors (rank 0 gathers the
                   TP shards), then load_hf_weights(ref) reads this rank's shards back; split
                   into reload_export_s and reload_load_s. The files are fresh in the page
                   cache, so this is a lower bound for a real disk.
Memory, without tracemalloc:
  *_storage_same   every reference parameter's data_ptr() is unchanged by the sync (no new
                   tensor was put in place of a parameter)
  *_peak_extra_mb  torch-allocator peak beyond the start of the call (benchmarks/_harness.py:
                   torch.profiler memory events; tensor bytes only)
  *_rss_delta_mb   psutil RSS after the call minus before (process-wide, coarse: includes
                   allocator caching)
  *_max_diff       |ref - expected| afterwards (0 for alpha=1 and the reload, ~1e-7 for lerp)
Times are medians of --repeats after one warm-up; rank 0 reports (all ranks do the same work).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import MODEL_SIZES as SIZES  # noqa: E402

from megagrpo.cli import torchrun_command  # noqa: E402


def _ptrs(model) -> list[int]:
    return [p.data_ptr() for p in model.parameters()]


def _max_diff(model, expected: list) -> float:
    import torch

    with torch.no_grad():
        return max(float((p - e).abs().max()) for p, e in zip(model.parameters(), expected))


def measure(fn, ref, repeats: int, expected_fn) -> dict:
    """Median time of fn() plus its memory footprint and exactness (see module doc)."""
    import psutil
    import torch
    import torch.distributed as dist
    from _harness import peak_extra_bytes

    cpu, proc = torch.device("cpu"), psutil.Process()
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    expected = expected_fn()
    before_ptrs, rss0 = _ptrs(ref), proc.memory_info().rss
    fn()
    rss1 = proc.memory_info().rss
    diff = _max_diff(ref, expected)
    same = _ptrs(ref) == before_ptrs
    del expected
    peak = peak_extra_bytes(fn, cpu)
    t = torch.tensor([statistics.median(times)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank bounds the step
    return dict(s=round(float(t), 5), storage_same=same, peak_extra_mb=round(peak / 2**20, 2),
                rss_delta_mb=round((rss1 - rss0) / 2**20, 2), max_diff=float(f"{diff:.2e}"))


def run_one(size: str, tp: int, repeats: int) -> dict | None:
    import torch
    import torch.distributed as dist

    from megagrpo.config.model import ModelConfig, ParallelConfig
    from megagrpo.runtime.distributed import init_distributed
    from megagrpo.hf import load_hf_weights
    from megagrpo.model.gpt import build_model
    from megagrpo.model.reference import sync_reference
    from megagrpo.sync.source import export_hf

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    mcfg = ModelConfig(architecture="llama", max_position_embeddings=256, **SIZES[size])
    par = ParallelConfig(tp=tp)
    info = init_distributed(par, mcfg)
    policy = build_model(mcfg, par, seed=0)
    ref = build_model(mcfg, par, seed=1)
    for p in ref.parameters():
        p.requires_grad_(False)
    n_local = sum(p.numel() for p in policy.parameters())
    # whole-model count: TP-split parameters times tp, replicated ones (norms) once (PP=1)
    n_total = sum(p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1)
                  for p in policy.parameters())

    def target_copy():
        return [p.detach().clone() for p in policy.parameters()]

    def target_lerp():
        return [r.detach().clone().lerp_(p.detach(), 0.5)
                for r, p in zip(ref.parameters(), policy.parameters())]

    a1 = measure(lambda: sync_reference(ref, policy, 1.0), ref, repeats, target_copy)
    a05 = measure(lambda: sync_reference(ref, policy, 0.5), ref, repeats, target_lerp)
    root = tempfile.mkdtemp(prefix="ref_sync_") if info.rank == 0 else ""
    box = [root]
    dist.broadcast_object_list(box, src=0)
    ckpt = os.path.join(box[0], "hf")
    phases = {"export": [], "load": []}

    def reload():
        t0 = time.perf_counter()
        export_hf(policy, ckpt, mcfg, par)
        dist.barrier()  # rank 0 wrote the files
        t1 = time.perf_counter()
        load_hf_weights(ref, ckpt, mcfg, par, tp_rank=info.tp_rank, pp_rank=info.pp_rank)
        phases["export"].append(t1 - t0)
        phases["load"].append(time.perf_counter() - t1)

    rl = measure(reload, ref, repeats, target_copy)
    nbytes = sum(f.stat().st_size for f in Path(ckpt).glob("*.safetensors"))
    dist.barrier()
    if info.rank != 0:
        return None
    shutil.rmtree(box[0], ignore_errors=True)
    rec = dict(size=size, tp=tp, params=n_total, local_params=n_local,
               local_bytes=n_local * 4, export_bytes=nbytes)
    for name, m in (("inplace_a1", a1), ("inplace_a05", a05), ("reload", rl)):
        rec[f"{name}_s"] = m.pop("s")
        rec.update({f"{name}_{k}": v for k, v in m.items()})
    rec["reload_export_s"] = round(statistics.median(phases["export"][1:1 + repeats]), 5)
    rec["reload_load_s"] = round(statistics.median(phases["load"][1:1 + repeats]), 5)
    rec["speedup_a1_vs_reload"] = round(rec["reload_s"] / rec["inplace_a1_s"], 1)
    rec["inplace_a1_gbps"] = round(n_local * 4 / rec["inplace_a1_s"] / 1e9, 2)
    rec.update(threads=torch.get_num_threads(), repeats=repeats,
               loadavg_1m=round(os.getloadavg()[0], 2))
    return rec


def launch(size: str, tp: int, repeats: int) -> dict:
    cmd = torchrun_command(tp, __file__, "--one", size, "--tp", str(tp), "--repeats",
                           str(repeats))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = [ln[7:] for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not found:
        sys.exit(f"size {size} tp {tp} failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(found[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--tps", default="1,2")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/reference_sync_cpu.jsonl")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        rec = run_one(args.one, args.tp, args.repeats)
        if rec is not None:
            print("RESULT " + json.dumps(rec), flush=True)
        from megagrpo.runtime.distributed import shutdown

        shutdown()
        return
    lines = []
    for tp in (int(t) for t in args.tps.split(",")):
        for size in args.sizes.split(","):
            line = json.dumps(launch(size, tp, args.repeats))
            print(line, flush=True)
            lines.append(line)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
