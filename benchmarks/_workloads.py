"""The named throughput workloads shared by grpo_step.py, trl_grpo_baseline.py and profile_step.py.

Only torch, transformers and megagrpo's config/data/task modules are imported, so the TRL venv
(`.venv-trl`: torch, trl, transformers; no megatron, no vLLM) can import this file too.

    demo     examples/demo.yaml at 32 prompts x G=8, max_tokens 6 (the 0.85M-parameter Llama,
             2-digit addition, vocab 19), beta 0.02
    varlen   a Llama megagrpo was not tuned on (hidden 256, 6 layers, 8 heads x 32, 4 KV groups,
             FFN 704), the arithmetic task's tokenizer and prompts, 16 prompts x G=8,
             max_tokens 96, temperature 1: a random-init model stops at EOS at random, so the
             completion lengths vary (roughly geometric, mean ~19 tokens with a 1/19 EOS chance);
             lr 1e-6: a random model earns no reward, so the steps only drift its weights, and at
             the demo's 3e-4 that drift shortened megagrpo's completions (mean 21 -> 8.5) but
             not TRL's, i.e. unequal work; at 1e-6 both keep the init's length distribution
    midsize  a 12.6M-parameter Llama (hidden 512, 4 layers, 8 heads x 64, 4 KV groups, FFN
             1536, the arithmetic tokenizer's vocab), 16 prompts x G=8, completions of up to 64
             tokens at temperature 1 (a random init stops at EOS at random, as in varlen, at
             1/19 per token), beta 0.04 so the reference pass runs every step, lr 1e-6 (a
             random model earns no reward; see varlen)
    moe      a small Qwen3-MoE of megagrpo's own design (hidden 256, 4 layers, 8 heads x 32, 4 KV
             groups, 8 routed experts of width 512, top-2 renormalised, every layer MoE: 13.4M
             parameters, 4.0M active per token; transformers' init, routers included), the
             arithmetic tokenizer and prompts, 16 prompts x G=8, completions of up to 32 tokens
             at temperature 1, beta 0.04, lr 1e-6 (as midsize); load-balancing loss at 0.001
    smollm2  the real SmolLM2-135M (`models/smollm2-135m`, fp32 HF folder) with
             examples/smollm2-135m-math-cpu.yaml: chat template, word problems, math reward;
             8 prompts x G=4, max_tokens 48 pinned here (the rest: the recipe's)

Both systems start from the same weights: the random-init workloads write one seeded init as an
HF folder (`benchmarks/.cache/<workload>-<dtype>/`, git-ignored, rebuilt when the workload's
architecture or seed changes) that megagrpo loads with `run.init=<folder>` and TRL with
`from_pretrained`; smollm2 uses the converted model folder itself. Every workload resets the
reference every GRPO step when it has one (beta > 0), as the benchmarks always did.

Useful model FLOPs (`forward_flops`, the numerator of every floor fraction): per real (non-pad)
token 2 x the matrix-multiply parameters of the transformer layers (q, k, v, output projection,
gate, up, down; embeddings are lookups), plus causal attention: the token at position t
(1-based) multiplies its query with t keys and its softmax row with t values, 4 x t x (heads x
head_dim) per layer - half of the 4 x S x hidden full-attention figure on average - plus the
output layer, 2 x hidden x vocab, at the loss positions only (the completion tokens). A backward
costs twice a forward, so an update pass is 3x these FLOPs; a scoring pass (old or reference
log-probs) is 1x.
A rollout (`rollout_flops`) is one forward over each group's prompt (prefilled once, with the
first token's logits, shared by its G samples) and over every sampled token but the last (the
last needs no successor), each with its logits: decode counted as what it is, one token per forward
whose attention reads the whole context, at the same GEMM rate (so the floor is a lower bound:
decode is a matrix-vector product, below the matrix-multiply rate on every CPU).

The FLOP floor of a phase is its useful FLOPs at torch.mm's best rate of the dtype measured in
the same run (`machine.gemm_gflops`); the fraction achieved is floor / measured time (for the
update and score phases the same number as their MFU).
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from megagrpo.runtime.machine import gemm_gflops  # noqa: F401 - the benchmarks' FLOP floor

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "benchmarks" / ".cache"
DTYPES = ("float32", "bfloat16")
# Settings every workload shares: no cold start, no evaluation, no checkpoints, a reference
# reset every step (reference.sync_every_steps is set only where beta > 0: see `overrides`).
COMMON = ("cold_start.steps=0", "eval.every=0", "run.resume=false", "log.tensorboard=false",
          "log.progress=false", "checkpoint.at_end=false")


@dataclass(frozen=True, kw_only=True)
class Workload:
    """One named benchmark workload: a recipe plus overrides."""

    name: str
    """demo, varlen, midsize, moe or smollm2."""
    recipe: str
    """The YAML recipe, relative to the repository root."""
    overrides: tuple[str, ...]
    """`key=value` overrides on top of the recipe."""
    model_dir: str = ""
    """A model folder the workload needs (relative to the root); '' = seeded random init."""
    data_file: str = ""
    """A data file its recipe reads (relative to the root) that no install step makes; ''
    = none (the built-in tasks)."""
    summary: str = ""
    """One line for console output."""


def _scaled(*, hidden: int, layers: int, head_dim: int, ffn: int, max_tokens: int,
            more: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The demo recipe scaled up: `hidden` x `layers` with 8 attention heads over 4 KV groups of
    `head_dim`, 128 positions, `max_tokens` sampled at temperature 1, 16 prompts a step, lr 1e-6
    (min_lr 0); then `more`."""
    return (f"model.hidden_size={hidden}", f"model.num_layers={layers}",
            "model.num_attention_heads=8", "model.num_query_groups=4",
            f"model.head_dim={head_dim}", f"model.ffn_hidden_size={ffn}",
            "model.max_position_embeddings=128", "rollout.max_model_len=128",
            f"rollout.max_tokens={max_tokens}", "rollout.temperature=1.0", "data.batch_size=16",
            "optim.lr=1.0e-6", "optim.min_lr=0", *more)


def workloads() -> dict[str, Workload]:
    """The named workloads (see the module docstring)."""
    return {w.name: w for w in (
        Workload(name="demo", recipe="examples/demo.yaml",
                 overrides=("data.batch_size=32",),
                 summary="demo Llama 0.85M, 32 prompts x G=8, max_tokens 6"),
        Workload(name="varlen", recipe="examples/demo.yaml",
                 overrides=_scaled(hidden=256, layers=6, head_dim=32, ffn=704, max_tokens=96),
                 summary="Llama hidden 256 x 6 layers, 16 prompts x G=8, max_tokens 96"),
        Workload(name="midsize", recipe="examples/demo.yaml",
                 overrides=_scaled(hidden=512, layers=4, head_dim=64, ffn=1536, max_tokens=64,
                                   more=("algo.group_size=8", "algo.beta=0.04")),
                 summary="Llama 12.6M (hidden 512 x 4 layers), 16 prompts x G=8, "
                         "max_tokens 64, beta 0.04"),
        Workload(name="moe", recipe="examples/demo.yaml",
                 overrides=("model.architecture=qwen3_moe", *_scaled(
                     hidden=256, layers=4, head_dim=32, ffn=704, max_tokens=32,
                     more=("model.num_experts=8", "model.moe_topk=2",
                           "model.moe_ffn_hidden_size=512", "algo.group_size=8",
                           "algo.beta=0.04"))),
                 summary="Qwen3-MoE 13.4M (8 experts top-2, 4.0M active), 16 prompts x G=8, "
                         "max_tokens 32, beta 0.04"),
        # the batch shape is pinned here, so edits of the training recipe keep the benchmark
        Workload(name="smollm2", recipe="examples/smollm2-135m-math-cpu.yaml",
                 overrides=("data.batch_size=8", "algo.group_size=4", "rollout.max_tokens=48"),
                 model_dir="models/smollm2-135m", data_file="data/word_problems/train.jsonl",
                 summary="SmolLM2-135M, word problems, 8 prompts x G=4, max_tokens 48"),
    )}


def get_workload(name: str) -> Workload:
    """The workload called `name`; a clear error for an unknown one."""
    table = workloads()
    if name not in table:
        raise SystemExit(f"--workload {name!r}: use one of {', '.join(table)}")
    return table[name]


def missing_model(w: Workload) -> str:
    """'' when the workload can run, else why not and how to fix it."""
    if w.model_dir and not (ROOT / w.model_dir / "config.json").exists():
        return (f"workload {w.name}: {w.model_dir} is absent; create it with `python -m megagrpo "
                f"convert --from-gguf smollm2 --to-hf {w.model_dir}` (and the word problems with "
                "`python -m megagrpo.tasks.word_problems data/word_problems`)")
    if w.data_file and not (ROOT / w.data_file).exists():
        return (f"workload {w.name}: {w.data_file} is absent; create it with `python -m "
                "megagrpo.tasks.word_problems data/word_problems`")
    return ""


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise SystemExit(f"--dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    return dtype


def _plain_overrides(w: Workload, dtype: str, extra: list[str] | tuple[str, ...]) -> list[str]:
    """Shared settings, the workload's, the precision, a reference reset every step where there
    is a reference (beta > 0), then the caller's `extra` (they win)."""
    from megagrpo.config.train import load_config

    over = [*COMMON, *w.overrides, f"model.dtype={dtype}", f"rollout.dtype={dtype}"]
    if load_config(str(ROOT / w.recipe), [*over, *extra]).algo.beta > 0:
        over.append("reference.sync_every_steps=1")  # every measured step pays one reset
    return [*over, *extra]


def base_config(w: Workload, dtype: str, extra: list[str] | tuple[str, ...] = ()):
    """The workload's TrainConfig without run.init (the architecture comes from the recipe)."""
    from megagrpo.config.train import load_config

    return load_config(str(ROOT / w.recipe), _plain_overrides(w, dtype, extra))


def overrides(w: Workload, dtype: str, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Every override megagrpo runs the workload with, run.init included (builds the seeded
    init folder on first use)."""
    init = str(ROOT / w.model_dir) if w.model_dir else str(ensure_init(w, dtype, extra))
    return [*_plain_overrides(w, dtype, extra), f"run.init={init}"]


def _hf_config(cfg) -> dict:
    """config.json for the workload's seeded init: megagrpo's HF config with the task's ids."""
    from megagrpo.hf import hf_config_dict
    from megagrpo.tasks import build_task

    tok = build_task(cfg.data, cfg.arithmetic).tokenizer
    hf = hf_config_dict(cfg.model)
    hf.update(bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    return hf


def ensure_init(w: Workload, dtype: str, extra: list[str] | tuple[str, ...] = ()) -> Path:
    """The seeded random init of a random-init workload as an HF folder in `dtype`, written once:
    torch.manual_seed(run.seed), transformers' own init (normal, std 0.02), cast to `dtype` (so
    the bf16 folder holds the fp32 folder's values, rounded). Rebuilt when the HF config or the
    seed it was made from changes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = base_config(w, dtype, extra)
    hf = _hf_config(cfg)
    key = json.dumps({"hf": hf, "seed": cfg.run.seed, "dtype": dtype}, sort_keys=True)
    out = CACHE / f"{w.name}-{dtype}"
    if (out / "workload_key.json").exists() and (out / "workload_key.json").read_text() == key:
        return out
    if hf.get("architectures") not in (["LlamaForCausalLM"], ["Qwen3MoeForCausalLM"]):
        raise SystemExit(f"workload {w.name}: only Llama and Qwen3-MoE random inits are "
                         f"supported, got {hf.get('architectures')}")
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{w.name}-{dtype}-", dir=CACHE))
    kw = {k: v for k, v in hf.items() if k not in ("architectures", "model_type", "torch_dtype")}
    torch.manual_seed(cfg.run.seed)
    config = AutoConfig.for_model(hf["model_type"], **kw)
    model = AutoModelForCausalLM.from_config(config).float().to(getattr(torch, dtype))
    model.save_pretrained(tmp)
    (tmp / "workload_key.json").write_text(key)
    shutil.rmtree(out, ignore_errors=True)
    try:
        os.replace(tmp, out)
    except OSError:  # another process wrote it first: its copy has the same seeded values
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# ---------------------------------------------------------------------------------------------
# figures shared by the benchmarks


def matmul_params_per_layer(model, layer: int = 0) -> int:
    """Matrix-multiply weights one token runs through in transformer layer `layer` (q, k, v,
    proj, gate, up, down; an MoE layer: its router and the top-k routed experts, plus a shared
    expert)."""
    H, hd = model.hidden_size, model.head_dim
    q, kv = model.num_attention_heads * hd, model.num_query_groups * hd
    attention = H * (q + 2 * kv) + q * H
    if not model.is_moe_layer(layer):
        return attention + 3 * H * model.ffn_hidden_size
    return (attention + H * model.num_experts + 3 * H * model.moe_topk * model.moe_ffn_hidden_size
            + 3 * H * model.shared_expert_ffn_hidden_size)


def forward_flops(model, lengths: torch.Tensor, loss_tokens: int | float) -> float:
    """Useful FLOPs of one forward over sequences of real `lengths` [n] with `loss_tokens`
    positions that need logits (module docstring: dense layers, causal attention, output layer
    at the loss positions)."""
    n = lengths.to(torch.float64)
    L, d = model.num_layers, model.num_attention_heads * model.head_dim
    per_token = sum(matmul_params_per_layer(model, i) for i in range(L))
    dense = 2.0 * per_token * float(n.sum())
    attention = L * 2.0 * d * float((n * (n + 1)).sum())  # sum over t=1..n of 4 t d
    return dense + attention + 2.0 * model.hidden_size * model.vocab_size * float(loss_tokens)


def rollout_flops(model, prompt_lengths: list[int], completion_lengths: list[list[int]]
                  ) -> float:
    """Useful FLOPs of sampling: per group, its prompt once with the first token's logits
    (shared by the G samples), then each completion's sampled tokens but the last, one forward
    each with its logits (module docstring)."""
    total = 0.0
    for p, comps in zip(prompt_lengths, completion_lengths):
        prefill = forward_flops(model, torch.tensor([p]), 0)
        total += prefill + forward_flops(model, torch.tensor([]), 1)  # + first-token logits
        for c in comps:  # the sample's decode steps on top of the prompt's keys and values
            steps = max(c - 1, 0)
            total += forward_flops(model, torch.tensor([p + steps]), steps) - prefill
    return total


def length_stats(lengths: list[int]) -> dict:
    """Completion-length distribution: mean, median, max (tokens)."""
    if not lengths:
        return dict(completion_len_mean=0.0, completion_len_p50=0.0, completion_len_max=0)
    return dict(completion_len_mean=round(statistics.mean(lengths), 2),
                completion_len_p50=float(statistics.median(lengths)),
                completion_len_max=int(max(lengths)))
