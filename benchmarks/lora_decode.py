"""vLLM decode with and without a LoRA adapter: what `lora.refit` chooses between.

A LoRA policy reaches vLLM in one of two ways (`megagrpo.sync.adapters`): the engine serves the
adapter (`enable_lora`, a LoRA request on every generate; refits carry the adapter only), or it
holds the merged weights W + s B A (a plain engine; every refit carries the model). Refit bytes
favour the first; decode speed may not. This script measures the decode side: the same HF model
and prompts, greedy, `--tokens` new tokens each (ignore_eos, so every mode decodes the same
count), in three engines, each in its own process (one in-process vLLM engine per process):

  merged   a plain engine (what `lora.refit=merged` runs: the merged weights cost nothing extra)
  adapter  an engine with enable_lora, every request with a rank-`--rank` adapter on all seven
           projections (random A and B at 0.01 scale)
  base     the enable_lora engine without a LoRA request (the engine's LoRA layers idle)

Best of `--repeats` after one warm-up generate; one JSON line per mode (CPU, torch capability,
threads, load average) to stdout and, with --out, appended to a file.

    python benchmarks/lora_decode.py --model models/smollm2-135m --out \\
        benchmarks/results/lora_decode_cpu.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _common import markdown_table, parser, print_table, records

PROJ = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
        "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(model: Path, out: Path, rank: int) -> Path:
    """A peft folder with a random rank-`rank` adapter on every projection of `model`."""
    import torch
    from safetensors.torch import save_file

    c = json.loads((model / "config.json").read_text())
    H, F, L = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    hd = c.get("head_dim") or H // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    dims = {"q_proj": (H, q), "k_proj": (H, kv), "v_proj": (H, kv), "o_proj": (q, H),
            "gate_proj": (H, F), "up_proj": (H, F), "down_proj": (F, H)}
    g, tensors = torch.Generator().manual_seed(0), {}
    for layer in range(L):
        for name, (i, o) in dims.items():
            p = f"base_model.model.model.layers.{layer}.{PROJ[name]}.{name}"
            tensors[f"{p}.lora_A.weight"] = torch.randn(rank, i, generator=g) * 0.01
            tensors[f"{p}.lora_B.weight"] = torch.randn(o, rank, generator=g) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(dims),
        "base_model_name_or_path": str(model), "bias": "none"}))
    return out


def measure(args) -> dict:
    """One mode in this process: tokens/s of the best of `repeats` greedy generates."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from megagrpo.runtime import machine

    kw = dict(model=args.model, dtype="float32", max_model_len=args.max_model_len, seed=0,
              enforce_eager=True, max_num_seqs=args.prompts, skip_tokenizer_init=True)
    if args.mode != "merged":
        kw.update(enable_lora=True, max_lora_rank=args.rank, max_loras=1)
    llm = LLM(**kw)
    req = None
    if args.mode == "adapter":
        folder = write_adapter(Path(args.model), Path(args.work) / "adapter", args.rank)
        req = LoRARequest("bench", 1, str(folder))
    prompts = [{"prompt_token_ids": [1 + (7 * i + j) % 90 for j in range(args.prompt_len)]}
               for i in range(args.prompts)]
    sp = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(prompts[:2], sp, lora_request=req, use_tqdm=False)
    best = float("inf")
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        out = llm.generate(prompts, sp, lora_request=req, use_tqdm=False)
        best = min(best, time.perf_counter() - t0)
    n = sum(len(o.outputs[0].token_ids) for o in out)
    return {"mode": args.mode, "model": str(args.model), "rank": args.rank,
            "prompts": args.prompts, "prompt_len": args.prompt_len, "new_tokens": n,
            "best_s": round(best, 4), "tokens_per_s": round(n / best, 1),
            "threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu": machine.cpu_name(), "load_avg": round(os.getloadavg()[0], 2)}


def table(path: str) -> str:
    """The results file as a markdown table, one row per measurement run (merged first)."""
    runs: list[dict] = []
    for r in records(path):  # a run is a merged row and the rows after it
        if r["mode"] == "merged" or not runs:
            runs.append({})
        runs[-1][r["mode"]] = r
    rows = []
    for run in runs:
        m, a, b = run.get("merged"), run.get("adapter"), run.get("base")
        first = m or a or b
        rows.append([f"{Path(first['model']).name}, r{first['rank']}, {first['prompts']} x "
                     f"{first['new_tokens'] // first['prompts']} tokens",
                     f"{first['cpu']} ({first['cpu_capability']}, {first['threads']} threads)",
                     first["load_avg"], _speed(m), _speed(a), _speed(b)])
    return markdown_table(["model", "CPU", "load", "merged tok/s", "adapter tok/s (x merged)",
                           "base on the LoRA engine tok/s (x merged)"], rows)


def _speed(r: dict | None) -> str:
    """A row's tokens per second and its ratio to the merged row's ('' for no row)."""
    return "" if r is None else f"{r['tokens_per_s']:.0f}" + (
        f" ({r['vs_merged']:.2f}x)" if "vs_merged" in r else "")


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--model", help="an HF model folder (llama/qwen family)")
    ap.add_argument("--table", default=None, help="print a results file as a markdown table")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="merged,adapter,base")
    ap.add_argument("--work", default="/tmp/megagrpo_lora_decode")
    ap.add_argument("--out", default=None)
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)  # one child's mode
    args = ap.parse_args()
    if print_table(args, table=table):
        return
    if not args.model:
        ap.error("--model is required (or --table FILE)")
    if args.mode:
        print("RESULT " + json.dumps(measure(args)), flush=True)
        return
    rows = []
    for mode in args.modes.split(","):
        cmd = [sys.executable, __file__, *sys.argv[1:], "--mode", mode]
        p = subprocess.run(cmd, capture_output=True, text=True)
        line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
        if p.returncode or line is None:
            raise SystemExit(f"mode {mode} failed (rc {p.returncode}):\n{p.stderr[-3000:]}")
        rows.append(json.loads(line[len("RESULT "):]))
        print(json.dumps(rows[-1]), flush=True)
    merged = next((r for r in rows if r["mode"] == "merged"), None)
    for r in rows:
        if merged and r is not merged:
            r["vs_merged"] = round(r["tokens_per_s"] / merged["tokens_per_s"], 3)
    print("decode tokens/s: " + ", ".join(
        f"{r['mode']} {r['tokens_per_s']}" + (f" ({r['vs_merged']}x merged)" if "vs_merged" in r
                                              else "") for r in rows))
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
