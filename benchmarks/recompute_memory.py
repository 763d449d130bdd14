"""Peak memory of one update pass (forward + backward) with compute.recompute none / selective /
full, 1 process (TP=1), CPU.

    .venv/bin/python benchmarks/recompute_memory.py [--seq 1024] [--batch 2]
        [--attention sdpa,megatron] [--recompute none,selective,full] [--threads 2]
        [--out benchmarks/results/recompute_cpu.jsonl]

Each (attention, recompute) setting runs in a fresh child process (the peak RSS is a process's
high-water mark): build the model (hidden 384, 6 layers, 6 heads x 64, 2 KV groups, FFN 1024,
vocab 1024, random init, fp32), then one forward + backward of a per-token CE loss on [b, S]
random tokens in training mode. One JSON line per setting:
  step_peak_mib   peak RSS during the step minus the RSS just before it (what the step's
                  activations and gradients add)
  peak_rss_mib    the process's peak RSS
  step_s          wall time of the step
  layer_forwards  forward calls of layer 0 in the step (2 under full: recomputed)
Selective recomputes megatron's core attention only, which holds the [b, heads, S, S] scores with
megatron's DotProductAttention and nothing that large with torch's SDPA (megagrpo's default).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MODEL = dict(vocab_size=1024, hidden_size=384, ffn_hidden_size=1024, num_layers=6,
             num_attention_heads=6, num_query_groups=2, head_dim=64)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(recompute: str, attention: str, seq: int, batch: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from megagrpo.config.model import ModelConfig, ParallelConfig
    from megagrpo.distributed import init_distributed
    from megagrpo.model import build_model

    mcfg = ModelConfig(**MODEL, max_position_embeddings=seq)
    par = ParallelConfig(attention_impl=attention, make_vocab_size_divisible_by=128)
    init_distributed(par, mcfg)
    gpt = build_model(mcfg, par, seed=0, recompute=(recompute, 1)).train()
    calls = [0]
    gpt.decoder.layers[0].register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, MODEL["vocab_size"], (batch, seq), generator=g)
    pos = torch.arange(seq).expand_as(ids)
    labels = torch.roll(ids, -1, dims=1)
    before = rss_mib()
    t0 = time.perf_counter()
    gpt(ids, pos, None, labels=labels).float().mean().backward()
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB
    return {"recompute": recompute, "attention": attention, "seq": seq, "batch": batch,
            "step_peak_mib": round(peak - before, 1), "peak_rss_mib": round(peak, 1),
            "step_s": round(wall, 2), "layer_forwards": calls[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--attention", default="sdpa,megatron")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--recompute", default="none,selective,full")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        recompute, attention = args.child.split(":")
        print(json.dumps(child(recompute, attention, args.seq, args.batch, args.threads)))
        return
    from benchmarks._harness import emit
    from megagrpo.cli import free_port

    for attention in args.attention.split(","):
        for recompute in args.recompute.split(","):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                       RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                       OMP_NUM_THREADS=str(args.threads))
            out = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--child", f"{recompute}:{attention}",
                 "--seq", str(args.seq), "--batch", str(args.batch),
                 "--threads", str(args.threads)],
                env=env, capture_output=True, text=True, check=True).stdout
            emit(json.loads(out.strip().splitlines()[-1]), args.out)


if __name__ == "__main__":
    main()
