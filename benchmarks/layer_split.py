"""Where a training pass's time goes, without a profiler: one megatron-core decoder forward +
backward (megagrpo's model, 1 rank, the local layer spec with SDPA) timed whole, then its
matrix multiplies and its attention timed alone at the same shapes; the rest is element-wise
work (RMSNorm, RoPE, SwiGLU, residual adds, the QKV split), copies and per-module overhead.

The profiler inflates small element-wise ops (it records each one; on a busy CPU an op's time
includes waiting for a descheduled OpenMP thread), so `profile_step.py`'s kernel split says
what runs but overstates its share; this script gives the unprofiled split. With
`--neighbour` each setting is also timed beside a busy process (a torch.mm loop on every core,
as a test suite or a second job would be): torch's OpenMP regions then wait for threads the OS
has descheduled. With `--compile` every setting is timed again with each decoder layer's
forward `torch.compile`d (inductor, dynamic shapes) as megatron-core builds it, and its
gradients checked against the eager pass.

The vocabulary is tiny on purpose (the output layer is not part of the split), so the figures
are the decoder layers'. FLOP floor: the layers' useful FLOPs (2 x matrix-multiply parameters
per token, causal attention 4 x t x heads x head_dim per token at position t, backward 2x) at
torch.mm's best 2048^3 rate of the dtype measured in the same run.

    python benchmarks/layer_split.py --preset midsize --threads 1,2 --neighbour --compile \
        --out F.jsonl
    python benchmarks/layer_split.py --table F.jsonl     # docs/performance.md's table
    python benchmarks/layer_split.py --device cuda --dtype bfloat16 --compile \
        --shape hidden=2048,ffn=5632,layers=2,heads=16,kv=8,head_dim=128,batch=8,seq=2048

On CUDA (`--device cuda`) the parts are timed the same way (synchronised around each call),
the floor's rate is torch.mm's at 8192^3 on the device, and --threads / --neighbour do not
apply.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import print_table  # noqa: E402
from _harness import emit, time_fn  # noqa: E402

PRESETS = {
    # the midsize workload's model and its update micro-batch (16 rows of ~64 tokens)
    "midsize": dict(hidden=512, ffn=1536, layers=4, heads=8, kv=4, head_dim=64, batch=16, seq=64),
    # SmolLM2-135M's layer shapes (6 of its 30 layers: the split is per layer), recipe-like rows
    "smollm2": dict(hidden=576, ffn=1536, layers=6, heads=9, kv=3, head_dim=64, batch=8, seq=160),
    "tiny": dict(hidden=64, ffn=128, layers=1, heads=2, kv=1, head_dim=32, batch=2, seq=16),
}
VOCAB = 256
CPU = torch.device("cpu")


def linear_shapes(p: dict) -> list[tuple[int, int]]:
    """(in, out) of one layer's products: fused QKV, attention output, gate+up, down."""
    q, kv = p["heads"] * p["head_dim"], p["kv"] * p["head_dim"]
    return [(p["hidden"], q + 2 * kv), (q, p["hidden"]), (p["hidden"], 2 * p["ffn"]),
            (p["ffn"], p["hidden"])]


def build(p: dict, dtype: str):
    from megagrpo.config.model import ModelConfig, ParallelConfig
    from megagrpo.runtime.distributed import init_distributed
    from megagrpo.model.gpt import build_model

    m = ModelConfig(hidden_size=p["hidden"], ffn_hidden_size=p["ffn"], num_layers=p["layers"],
                    num_attention_heads=p["heads"], num_query_groups=p["kv"],
                    head_dim=p["head_dim"], vocab_size=VOCAB, dtype=dtype,
                    max_position_embeddings=max(256, p["seq"]))
    par = ParallelConfig()
    init_distributed(par, m)
    model = build_model(m, par)
    # the products timed alone must be the model's: its decoder's matrix weights, counted
    got = sum(w.numel() for n, w in model.decoder.named_parameters()
              if w.dim() == 2 and "router" not in n)
    want = p["layers"] * sum(i * o for i, o in linear_shapes(p))
    if got != want:
        raise SystemExit(f"layer_split: the model's matrix weights ({got}) are not the shapes "
                         f"timed alone ({want}): update linear_shapes")
    return model


def measure(model, p: dict, dtype: torch.dtype, iters: int, dev: torch.device = CPU) -> dict:
    b, s, layers = p["batch"], p["seq"], p["layers"]
    t = b * s
    ids, pos = (x.to(dev) for x in batch(p))

    def step():
        train_pass(model, ids, pos)

    def fwd():
        with torch.no_grad():
            model(ids, pos, None)

    full, forward = time_fn(step, dev, iters=iters), time_fn(fwd, dev, iters=iters)
    gemm_f = gemm_b = 0.0
    gemm_flops = 0
    for i, o in linear_shapes(p):
        x, w, dy = (torch.randn(*sh, dtype=dtype, device=dev) for sh in ((t, i), (i, o), (t, o)))
        gemm_f += layers * time_fn(lambda: x @ w, dev, iters=iters)
        gemm_b += layers * (time_fn(lambda: dy @ w.t(), dev, iters=iters)
                            + time_fn(lambda: dy.t() @ x, dev, iters=iters))
        gemm_flops += 3 * layers * 2 * t * i * o
    q = torch.randn(b, p["heads"], s, p["head_dim"], dtype=dtype, device=dev,
                    requires_grad=True)
    k, v = (torch.randn(b, p["kv"], s, p["head_dim"], dtype=dtype, device=dev,
                        requires_grad=True) for _ in range(2))

    def attn():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()

    def attn_fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    att = layers * time_fn(attn, dev, iters=iters)
    att_f = layers * time_fn(attn_fwd, dev, iters=iters)
    # causal: position j (1-based) attends to j keys: 4 j heads head_dim FLOPs, summed over j
    attn_flops = 3 * layers * b * 4 * p["heads"] * p["head_dim"] * s * (s + 1) // 2
    return dict(step_s=full, forward_s=forward, gemm_s=gemm_f + gemm_b, gemm_fwd_s=gemm_f,
                attention_s=att, attention_fwd_s=att_f, gemm_flops=gemm_flops,
                attention_flops=attn_flops)


def batch(p: dict, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (p["batch"], p["seq"]), generator=g)
    return ids, torch.arange(p["seq"]).expand(p["batch"], p["seq"])


def train_pass(model, ids: torch.Tensor, pos: torch.Tensor) -> None:
    """One forward + backward of a fixed scalar of the output."""
    model.zero_grad(set_to_none=True)
    model(ids, pos, None).float().sum().mul(1e-3).backward()


def grads(model, p: dict, dev: torch.device = CPU) -> list[torch.Tensor]:
    """Every parameter's gradient of one pass on a fixed batch."""
    train_pass(model, *(x.to(dev) for x in batch(p)))
    return [w.grad.detach().clone() for w in model.parameters()]


def compile_layers(model, p: dict, dev: torch.device = CPU) -> dict:
    """compute.compile_layers on the model (`megagrpo.model.compile`: torch.compile, inductor,
    dynamic shapes, of each decoder layer's forward): the compile time of the first pass, the graphs
    dynamo made of one layer, and the largest gradient difference against the eager pass
    relative to the gradient's scale."""
    import torch._dynamo

    from megagrpo.model.compile import compile_layers as compile_model, graph_count

    eager = grads(model, p, dev)
    torch._dynamo.reset()
    n = compile_model(model)
    before = graph_count()
    t0 = time.perf_counter()
    compiled = grads(model, p, dev)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - t0
    rel = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
              for a, b in zip(compiled, eager))
    return dict(compile_s=round(seconds, 1), graphs=(graph_count() - before) / max(1, n),
                grad_max_rel_diff=rel)


def eager_again(model, p: dict, dev: torch.device = CPU) -> None:
    """The layers' own forwards back (the compiled ones dropped), for an eager row after the
    compiled rows."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    for m in model.modules():
        if isinstance(m, TransformerLayer) and "forward" in vars(m):
            del m.forward
    return None


def start_neighbour(threads: int) -> subprocess.Popen:
    code = (f"import torch; torch.set_num_threads({threads}); a = torch.randn(1024, 1024)\n"
            "while True: a @ a")
    proc = subprocess.Popen([sys.executable, "-c", code])
    time.sleep(1.0)  # started and busy
    return proc


def row(p: dict, name: str, dtype: str, threads: int, neighbour: int, rate: float,
        m: dict, compiled: dict | None = None, dev: torch.device = CPU) -> dict:
    step = m["step_s"]
    # not clamped at 0: parts timed alone that exceed the pass they are part of show as a
    # negative rest instead of a plausible 0
    rest = step - m["gemm_s"] - m["attention_s"]
    floor = (m["gemm_flops"] + m["attention_flops"]) / (rate * 1e9)
    r = lambda x: round(x, 4)  # noqa: E731
    return dict(preset=name, shapes=p, tokens=p["batch"] * p["seq"], dtype=dtype,
                threads=threads, neighbour_threads=neighbour,
                cpu=torch.backends.cpu.get_cpu_capability(),
                **({"device": torch.cuda.get_device_name(dev)} if dev.type == "cuda" else {}),
                load_avg_1m=round(os.getloadavg()[0], 2), mm_gflops=round(rate, 1),
                step_s=r(step), forward_s=r(m["forward_s"]), gemm_s=r(m["gemm_s"]),
                attention_s=r(m["attention_s"]), rest_s=r(rest),
                gemm_share=r(m["gemm_s"] / step), attention_share=r(m["attention_s"] / step),
                rest_share=r(rest / step),
                gemm_rate_frac=r(m["gemm_flops"] / m["gemm_s"] / 1e9 / rate),
                attention_rate_frac=r(m["attention_flops"] / m["attention_s"] / 1e9 / rate),
                floor_s=r(floor), floor_frac=r(floor / step), compiled=compiled)


def table(path: str) -> str:
    import json

    rows = [json.loads(ln) for ln in open(path) if ln.strip()]
    out = ["| shapes | threads | beside a busy process | fwd+bwd | GEMMs alone | attention "
           "alone | the rest | GEMM / attention rate vs torch.mm | of the FLOP floor |",
           "|---|---|---|---|---|---|---|---|---|"]
    def comp(x: dict) -> str:
        c = x.get("compiled")
        return (f", layers compiled ({c['graphs']:g} graphs a layer, first pass {c['compile_s']}"
                " s)") if c else ""

    for x in rows:
        busy = f"yes ({x['neighbour_threads']} threads)" if x["neighbour_threads"] else "no"
        out.append(
            f"| {x['preset']} ({x['tokens']} tokens, {x['dtype']}){comp(x)} | {x['threads']} | "
            f"{busy} | "
            f"{x['step_s'] * 1e3:.0f} ms | {x['gemm_s'] * 1e3:.0f} ms ({x['gemm_share']:.0%}) | "
            f"{x['attention_s'] * 1e3:.0f} ms ({x['attention_share']:.0%}) | "
            f"{x['rest_s'] * 1e3:.0f} ms ({x['rest_share']:.0%}) | "
            f"{x['gemm_rate_frac']:.0%} / {x['attention_rate_frac']:.0%} | "
            f"{x['floor_frac']:.1%} |")
    return "\n".join(out)


def compiled_table(path: str) -> str:
    """compute.compile_layers against eager: each quiet compiled row beside the eager rows of
    the same shapes and threads right before and (--ab) after it; the ratios against the
    faster of them."""
    import json

    rows = [json.loads(ln) for ln in open(path) if ln.strip()]
    out = ["| shapes | threads | load (1 min), eager / compiled | eager fwd+bwd, before / "
           "after | compiled | compiled / faster eager | the rest, eager -> compiled | "
           "of the FLOP floor, eager -> compiled | graphs (training pass, all layers) | "
           "first pass (compile) | grad max rel. diff |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    def key(x: dict) -> tuple:
        return (x["preset"], json.dumps(x["shapes"], sort_keys=True), x["threads"],
                x["neighbour_threads"])

    for i, x in enumerate(rows):
        c = x.get("compiled")
        if not c or x["neighbour_threads"]:
            continue
        # the eager rows of the same run: the one before, and the one after with --ab
        around = [r for r in (*rows[:i][::-1][:1], *rows[i + 1:][:1])
                  if not r.get("compiled") and key(r) == key(x)]
        if not around:
            continue
        # the faster eager row (a fair bar for the compiled one on a shared machine)
        e = dict(min(around, key=lambda r: r["step_s"]))
        e["load_avg_1m"] = "/".join(str(r["load_avg_1m"]) for r in around)
        e["steps"] = " / ".join(f"{r['step_s'] * 1e3:.0f}" for r in around)
        sh = x["shapes"]
        out.append(
            f"| {x['preset']} (h {sh['hidden']}, ffn {sh['ffn']}, {sh['layers']} layers, "
            f"{x['tokens']} tokens, {x['dtype']}) | {x['threads']} | "
            f"{e['load_avg_1m']} / {x['load_avg_1m']} | {e['steps']} ms | "
            f"{x['step_s'] * 1e3:.0f} ms | {x['step_s'] / e['step_s']:.2f}x | "
            f"{e['rest_s'] * 1e3:.0f} -> {x['rest_s'] * 1e3:.0f} ms "
            f"({e['rest_share']:.0%} -> {x['rest_share']:.0%}) | "
            f"{e['floor_frac']:.1%} -> {x['floor_frac']:.1%} | "
            f"{round(c['graphs'] * sh['layers'])} | "
            f"{c['compile_s']} s | {c['grad_max_rel_diff']:.1e} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="midsize", choices=sorted(PRESETS))
    ap.add_argument("--shape", default="", metavar="KEY=N,...",
                    help="a shape of your own: the preset's values overridden (hidden, ffn, "
                    "layers, heads, kv, head_dim, batch, seq); rows named 'custom'")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--threads", default="", help="comma-separated thread counts (default: "
                    "every core)")
    ap.add_argument("--neighbour", action="store_true",
                    help="also time each setting beside a busy torch.mm process on every core")
    ap.add_argument("--compile", action="store_true",
                    help="then every setting again with each decoder layer torch.compile'd")
    ap.add_argument("--ab", action="store_true",
                    help="with --compile: the eager layers timed once more after the compiled "
                    "ones (A/B/A on a shared machine)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=None, help="append the JSON lines to this file too")
    ap.add_argument("--table", default=None, metavar="JSONL",
                    help="only print the markdown table of these result lines")
    ap.add_argument("--compiled-table", default=None, metavar="JSONL",
                    help="only print the compiled-vs-eager markdown table of these lines")
    args = ap.parse_args(argv)
    if print_table(args, table=table, compiled_table=compiled_table):
        return
    cores = os.cpu_count() or 1
    threads = [int(x) for x in args.threads.split(",")] if args.threads else [cores]
    dev = torch.device(args.device)
    if dev.type == "cuda" and (args.neighbour or len(threads) > 1):
        raise SystemExit("layer_split: --neighbour and several --threads are CPU settings; "
                         "drop them with --device cuda")
    p, dtype = dict(PRESETS[args.preset]), getattr(torch, args.dtype)
    name = args.preset
    if args.shape:
        for item in args.shape.split(","):
            key, _, value = item.partition("=")
            if key not in p:
                raise SystemExit(f"layer_split: --shape {key!r} is not one of {sorted(p)}")
            p[key] = int(value)
        name = "custom"
    model = build(p, args.dtype)
    from megagrpo.runtime.machine import gemm_gflops

    rates = {}
    if dev.type == "cuda":  # the device's rate, whatever the host's threads
        from gpu_step import mm_tflops

        rates = dict.fromkeys(threads, mm_tflops(dev, dtype)[0] * 1e3)
    passes = [None, *([compile_layers] if args.compile else []),
              *([eager_again] if args.compile and args.ab else [])]
    for compiled in passes:
        info = compiled(model, p, dev) if compiled else None
        for n in threads:
            torch.set_num_threads(n)
            if n not in rates:  # the floor's rate: this thread count, quiet
                rates[n] = gemm_gflops(args.dtype, n, size=2048, iters=3)[0]
            for busy in ([0, cores] if args.neighbour else [0]):
                proc = start_neighbour(busy) if busy else None
                try:
                    m = measure(model, p, dtype, args.iters, dev)
                finally:
                    if proc is not None:
                        proc.kill()
                        proc.wait()
                emit(row(p, name, args.dtype, n, busy, rates[n], m, info, dev), args.out)


if __name__ == "__main__":
    main()
