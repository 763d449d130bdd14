"""Core attention in a megatron GPTModel forward + backward: megatron's local DotProductAttention
vs megagrpo's SdpaAttention (torch's fused scaled_dot_product_attention), 1 process.

    .venv/bin/python benchmarks/attention.py [--shapes demo,varlen,smollm2]
        [--dtypes float32,bfloat16] [--iters 5] [--threads 2]
        [--out benchmarks/results/attention_cpu.jsonl]

Shapes (as in benchmarks/_workloads.py; random init; the step includes the vocab pass):
  demo     hidden 128, 4 layers, 4 heads x 32, 2 KV groups, vocab 19, b=64, S=13
  varlen   hidden 256, 6 layers, 8 heads x 32, 4 KV groups, FFN 704, vocab 19, b=16, S=110
  smollm2  hidden 576, 30 layers, 9 heads x 64, 3 KV groups, vocab 49152, b=4, S=100
One JSON line per (shape, dtype):
  step_s_<impl>       min wall time of one GPTModel forward + backward (per-token CE loss)
                      built with parallel.attention_impl=<impl>; both models are timed in
                      turn, so both see the same load
  step_cpu_s_<impl>   min process CPU seconds of the same (all threads)
  speedup             step_s_megatron / step_s_sdpa (speedup_cpu: the same in CPU seconds)
  attn_s_<impl>       core-attention forward + backward per step: the module alone on
                      [S, b, heads, head_dim] inputs (min time) x layers
  attn_share_<impl>   attn_s_<impl> / step_s_<impl>
  max_rel_diff        max |logits_sdpa - logits_megatron| / max |logits_megatron| (same weights)
  kernels_<impl>      the aten attention ops a forward of that model ran (profiler)
Min times, not medians: other processes share these cores and only ever add time; under load
`--threads 1` is the steadier measure (no thread waits at a barrier for a descheduled peer).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks._harness import emit  # noqa: E402

SHAPES = {
    "demo": dict(model=dict(hidden_size=128, num_layers=4, num_attention_heads=4,
                            num_query_groups=2, head_dim=32, ffn_hidden_size=256, vocab_size=19),
                 batch=64, seq=13),
    "varlen": dict(model=dict(hidden_size=256, num_layers=6, num_attention_heads=8,
                              num_query_groups=4, head_dim=32, ffn_hidden_size=704,
                              vocab_size=19), batch=16, seq=110),
    "smollm2": dict(model=dict(hidden_size=576, num_layers=30, num_attention_heads=9,
                               num_query_groups=3, head_dim=64, ffn_hidden_size=1536,
                               vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0),
                    batch=4, seq=100),
}
IMPLS = ("megatron", "sdpa")


def interleaved_min(fns: dict[str, Callable[[], object]],
                    iters: int) -> dict[str, tuple[float, float]]:
    """(min wall seconds, min process CPU seconds) of each fn, calling them in turn (one warm-up
    round first) so that every fn sees the same load from the processes sharing these cores."""
    best = {name: (float("inf"), float("inf")) for name in fns}
    for i in range(iters + 1):
        for name, fn in fns.items():
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            if i:
                best[name] = (min(best[name][0], wall), min(best[name][1], cpu))
    return best


def model_step(model_kw: dict, dtype: str, impl: str,
               ids: torch.Tensor) -> tuple[Callable[[], None], torch.Tensor, list[str]]:
    """(one GPTModel forward + backward with a per-token CE loss, the logits [b, S, V_padded],
    the attention kernels torch ran in that forward) for a model built with
    parallel.attention_impl=impl (same seed, so same weights)."""
    from megagrpo.config.model import ModelConfig, ParallelConfig
    from megagrpo.model.gpt import build_model

    mcfg = ModelConfig(**model_kw, dtype=dtype, max_position_embeddings=512)
    gpt = build_model(mcfg, ParallelConfig(attention_impl=impl), seed=0)
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    labels = torch.roll(ids, -1, dims=1)

    def fwd_bwd() -> None:
        gpt(ids, pos, None, labels=labels).float().mean().backward()

    got = type(gpt.decoder.layers[0].self_attention.core_attention).__name__
    want = "SdpaAttention" if impl == "sdpa" else "DotProductAttention"
    if got != want:
        raise RuntimeError(f"attention_impl={impl!r} built {got}, expected {want}")
    with torch.no_grad(), torch.profiler.profile() as prof:
        logits = gpt(ids, pos, None).float().clone()
    return fwd_bwd, logits, sorted({e.key for e in prof.key_averages() if "attention" in e.key})


def attention_step(model_kw: dict, dtype: str, impl: str, batch: int,
                   seq: int) -> Callable[[], None]:
    """One core-attention forward + backward on random [S, b, heads, head_dim] inputs."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megagrpo.parallel.attention import SdpaAttention
    from megagrpo.config.model import ModelConfig, ParallelConfig
    from megagrpo.model.gpt import DTYPE, transformer_config

    mcfg = ModelConfig(**model_kw, dtype=dtype)
    cfg = transformer_config(mcfg, ParallelConfig())
    cls = SdpaAttention if impl == "sdpa" else DotProductAttention
    attn = cls(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
               attention_type="self")
    g = torch.Generator().manual_seed(0)
    shape = (seq, batch, mcfg.num_attention_heads, mcfg.head_dim)
    kv_shape = (seq, batch, mcfg.num_query_groups, mcfg.head_dim)
    q, k, v = (torch.randn(s, generator=g).to(DTYPE[dtype]).requires_grad_()
               for s in (shape, kv_shape, kv_shape))
    grad = torch.randn(seq, batch, shape[2] * shape[3], generator=g).to(DTYPE[dtype])

    def fwd_bwd() -> None:
        attn(q, k, v, None).backward(grad)

    return fwd_bwd


def run_case(name: str, dtype: str, iters: int) -> dict:
    shape = SHAPES[name]
    model_kw, b, s = shape["model"], shape["batch"], shape["seq"]
    layers = model_kw["num_layers"]
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model_kw["vocab_size"], (b, s), generator=gen)
    rec: dict = {"shape": name, "dtype": dtype, "batch": b, "seq": s, "layers": layers,
                 "threads": torch.get_num_threads()}
    steps, logits = {}, {}
    for impl in IMPLS:
        steps[impl], logits[impl], kernels = model_step(model_kw, dtype, impl, ids)
        rec[f"kernels_{impl}"] = kernels
    step_s = interleaved_min(steps, iters)
    del steps
    attn_s = interleaved_min({i: attention_step(model_kw, dtype, i, b, s) for i in IMPLS}, iters)
    for impl in IMPLS:
        (rec[f"step_s_{impl}"], rec[f"step_cpu_s_{impl}"]) = step_s[impl]
        rec[f"attn_s_{impl}"] = attn_s[impl][0] * layers
        rec[f"attn_share_{impl}"] = attn_s[impl][0] * layers / step_s[impl][0]
    rec["speedup"] = step_s["megatron"][0] / step_s["sdpa"][0]
    rec["speedup_cpu"] = step_s["megatron"][1] / step_s["sdpa"][1]
    ref = logits["megatron"]
    rec["max_rel_diff"] = ((logits["sdpa"] - ref).abs().max() / ref.abs().max()).item()
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="demo,varlen,smollm2")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from megagrpo.config.model import ParallelConfig
    from megagrpo.runtime.distributed import init_distributed

    torch.set_num_threads(args.threads)
    init_distributed(ParallelConfig())
    for name in args.shapes.split(","):
        for dtype in args.dtypes.split(","):
            t0 = time.perf_counter()
            rec = run_case(name, dtype, args.iters)
            rec["bench_s"] = time.perf_counter() - t0
            emit(rec, args.out)


if __name__ == "__main__":
    main()
