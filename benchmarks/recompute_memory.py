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
  saved_mib       bytes autograd saved for backward in the transformer layers' forward
                  (distinct storages, parameters left out): the activations the planner
                  estimates, without the backward's own working set and the allocator's cached
                  blocks that the RSS peak also holds (under full recomputation: the kept layer
                  inputs only, the recomputed chunk exists in backward)
  planner_mib     `megagrpo plan`'s figure for the same step: its activation estimate
                  (`megagrpo.plan.activation_bytes`, recompute and attention as run) + the
                  fp32 gradients of every parameter + the logits path (megatron's output layer
                  and cross-entropy: `logits_bytes` with the fused output layer off)
  planner_error   (planner_mib - step_peak_mib) / step_peak_mib
  planner_act_mib the planner's activation estimate alone; planner_act_error its error
                  against saved_mib
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
from functools import partial

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
    saved: dict[int, int] = {}
    before = rss_mib()
    t0 = time.perf_counter()
    hooks = torch.autograd.graph.saved_tensors_hooks(partial(_note_saved, saved), lambda t: t)
    gpt.decoder.register_forward_pre_hook(lambda *_: hooks.__enter__())
    gpt.decoder.register_forward_hook(lambda *_: hooks.__exit__(None, None, None))
    gpt(ids, pos, None, labels=labels).float().mean().backward()
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB
    return {"recompute": recompute, "attention": attention, "seq": seq, "batch": batch,
            "step_peak_mib": round(peak - before, 1), "peak_rss_mib": round(peak, 1),
            "step_s": round(wall, 2), "layer_forwards": calls[0],
            "saved_mib": round(sum(saved.values()) / 2**20, 1)}


def _note_saved(saved: dict, t):
    """saved_tensors_hooks pack: records each saved non-parameter storage once (views of one
    tensor share it); returns the tensor itself (nothing is copied)."""
    import torch

    if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
        st = t.untyped_storage()
        saved.setdefault(st.data_ptr(), st.nbytes())
    return t


def planner_mib(recompute: str, attention: str, seq: int, batch: int) -> tuple[float, float]:
    """The planner's estimate of the step's peak and its activation term (see the module
    docstring), MiB."""
    from megagrpo.config.train import load_config
    from megagrpo.plan import activation_bytes, logits_bytes, total_params

    cfg = load_config(None, [f"model.{k}={v}" for k, v in MODEL.items()] + [
        "model.dtype=float32", f"model.max_position_embeddings={seq}",
        f"rollout.max_model_len={seq}", f"compute.micro_batch_size={batch}",
        f"compute.recompute={recompute}", f"parallel.attention_impl={attention}",
        "parallel.transformer_impl=local", "parallel.make_vocab_size_divisible_by=128",
        "compute.fused_output_layer=false", "compute.inplace_backward=false"])
    m = cfg.model
    act = activation_bytes(cfg, m, 1, 1)
    total = act + logits_bytes(cfg, m, 1, cfg.parallel)[0] + 4 * total_params(m)
    return total / 2**20, act / 2**20


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
            rec = json.loads(out.strip().splitlines()[-1])
            est, act = planner_mib(recompute, attention, args.seq, args.batch)
            rec.update(planner_mib=round(est, 1),
                       planner_error=round((est - rec["step_peak_mib"]) / rec["step_peak_mib"], 3),
                       planner_act_mib=round(act, 1),
                       planner_act_error=round((act - rec["saved_mib"]) / rec["saved_mib"], 3))
            emit(rec, args.out)


if __name__ == "__main__":
    main()
