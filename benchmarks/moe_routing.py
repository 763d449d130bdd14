"""The train-inference routing mismatch of MoE: how often vLLM, while it samples, routes a token
to other experts than megatron does when the trainer scores the same sequence.

On the `moe` workload's model (benchmarks/_workloads.py; or --hf DIR), one process:
1. vLLM (in-process, the engine megagrpo uses) samples G completions for each prompt.
   `megagrpo.model.moe.RouteCapture` (the capture routing replay uses) hooks every MoE layer's
   router and the model runner's batch layout at each forward, so each token row maps to (request,
   position): the routing vLLM actually used while decoding, no re-run.
2. megatron (the trainer's GPTModel at TP=1, loaded from the same HF folder) runs each prompt +
   completion once, as the scoring pass does; a hook on every router records its top-k.
3. For every sampled token's input position (the last prompt token and every completion token
   but the last) and every MoE layer, the two top-k sets are compared.

Prints one JSON line per dtype: the share of (token, layer) pairs whose top-k sets differ, the
share of tokens that differ in at least one layer, the mean and max |log-prob| gap between
vLLM's sampling log-probs and the trainer's, the same gap over the tokens whose routing agrees
in every layer, and the gap when the trainer's forward replays vLLM's routes (routing replay,
`algo.routing_replay`: `megagrpo.model.moe.replay`, megatron's RouterReplay).

    python benchmarks/moe_routing.py [--dtypes float32,bfloat16] [--prompts 16] [--out FILE]
    python benchmarks/moe_routing.py --table benchmarks/results/moe_routing_cpu.jsonl  # markdown
"""
from __future__ import annotations

import os
from contextlib import nullcontext
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import markdown_table, parser, print_table, records  # noqa: E402
from _harness import emit  # noqa: E402
from _workloads import base_config, ensure_init, get_workload  # noqa: E402


def megatron_routes(gpt, ids: torch.Tensor, topk: int, vocab: int,
                    replayed: torch.Tensor | None = None) -> tuple[list, torch.Tensor]:
    """([S][L_moe] top-k lists, [S, V] fp32 log-probs) of one sequence through the trainer's
    model (eval mode, like a scoring pass); `replayed` [S, L_moe, k]: routed as given
    (`megagrpo.model.moe.replay`, the path of algo.routing_replay) instead of by its own routers."""
    from megagrpo.model.moe import replay

    from megatron.core.transformer.moe.router import TopKRouter

    per_layer: list[torch.Tensor] = []

    def record(module, args, output) -> None:
        _, routing_map = output
        per_layer.append(routing_map.nonzero()[:, 1].view(-1, topk))

    hooks = [m.register_forward_hook(record) for m in gpt.modules() if isinstance(m, TopKRouter)]
    try:
        with torch.no_grad(), (replay(gpt, replayed) if replayed is not None else nullcontext()):
            pos = torch.arange(ids.numel())[None]
            logits = gpt(ids[None], pos, None)[0, :, :vocab].float()  # no TP padding rows
    finally:
        for h in hooks:
            h.remove()
    rows = [[layer[s].sort().values.tolist() for layer in per_layer] for s in range(ids.numel())]
    return rows, torch.log_softmax(logits, dim=-1)


def measure(hf_dir: Path, dtype: str, prompts: list[list[int]], group: int, max_tokens: int,
            temperature: float, seed: int) -> dict:
    from vllm import LLM, SamplingParams

    from megagrpo.config.model import ParallelConfig
    from megagrpo.runtime.distributed import init_distributed
    from megagrpo.hf import load_hf_weights, model_config_from_hf
    from megagrpo.model.gpt import build_model
    from megagrpo.model.moe import RouteCapture

    init_distributed(ParallelConfig())  # again: a closed vLLM engine takes the group down
    model = model_config_from_hf(hf_dir, dtype=dtype)
    parallel = ParallelConfig(make_vocab_size_divisible_by=8)
    gpt = build_model(model, parallel).eval()
    load_hf_weights(gpt, hf_dir, model, parallel, tp_rank=0, pp_rank=0)
    llm = LLM(model=str(hf_dir), dtype=dtype, enforce_eager=True, seed=seed,
              max_model_len=model.max_position_embeddings, skip_tokenizer_init=True,
              enable_prefix_caching=False)  # every request computes (and routes) its prompt
    rec = RouteCapture(llm, model.moe_topk)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, logprobs=0)
    reqs = [{"prompt_token_ids": p} for p in prompts for _ in range(group)]
    outs = llm.generate(reqs, params, use_tqdm=False)
    pairs = differ_pairs = tokens = differ_tokens = 0
    gaps, agreeing_gaps, replay_gaps = [], [], []
    for out in outs:
        prompt, comp = list(out.prompt_token_ids), out.outputs[0]
        seq = prompt + list(comp.token_ids)
        ours, logp = megatron_routes(gpt, torch.tensor(seq), model.moe_topk, model.vocab_size)
        theirs = rec.routes.get(out.request_id, {})
        _, logp_replayed = megatron_routes(gpt, torch.tensor(seq), model.moe_topk,
                                           model.vocab_size, rec.sequence(out.request_id,
                                                                          len(seq)))
        for j, tok in enumerate(comp.token_ids):
            p = len(prompt) - 1 + j  # the input position whose forward sampled `tok`
            v = theirs.get(p)
            gap = abs(comp.logprobs[j][tok].logprob - float(logp[p, tok]))
            gaps.append(gap)
            replay_gaps.append(abs(comp.logprobs[j][tok].logprob - float(logp_replayed[p, tok])))
            if v is None or any(x is None for x in v):
                continue
            diff = [a != b for a, b in zip(v, ours[p])]
            pairs += len(diff)
            differ_pairs += sum(diff)
            tokens += 1
            differ_tokens += int(any(diff))
            if not any(diff):
                agreeing_gaps.append(gap)
    del llm
    t = torch.tensor(gaps or [0.0])
    a = torch.tensor(agreeing_gaps or [0.0])
    r = torch.tensor(replay_gaps or [0.0])
    return {"bench": "moe_routing", "model": str(hf_dir.name), "dtype": dtype,
            "moe_layers": sum(model.is_moe_layer(i) for i in range(model.num_layers)),
            "experts": model.num_experts, "topk": model.moe_topk, "sequences": len(outs),
            "tokens_compared": tokens, "sampled_tokens": len(gaps),
            "routing_mismatch_pairs": differ_pairs / max(pairs, 1),
            "routing_mismatch_tokens": differ_tokens / max(tokens, 1),
            "logp_gap_mean": float(t.mean()), "logp_gap_max": float(t.max()),
            "logp_gap_mean_same_routing": float(a.mean()),
            "logp_gap_mean_replayed": float(r.mean()), "logp_gap_max_replayed": float(r.max()),
            "cpu": torch.backends.cpu.get_cpu_capability()}


def table(path: str) -> str:
    """docs/performance.md's table from the JSON lines this script wrote."""
    return markdown_table(
        ["dtype", "CPU", "tokens", "(token, layer) pairs routed differently",
         "tokens routed differently in >= 1 layer", "log-prob gap mean / max",
         "same routing: gap mean", "routing replay: gap mean / max"],
        ([r["dtype"], r["cpu"], r["tokens_compared"], f"{100 * r['routing_mismatch_pairs']:.2f}%",
          f"{100 * r['routing_mismatch_tokens']:.2f}%",
          f"{r['logp_gap_mean']:.2e} / {r['logp_gap_max']:.2e}",
          f"{r['logp_gap_mean_same_routing']:.2e}",
          f"{r['logp_gap_mean_replayed']:.2e} / {r['logp_gap_max_replayed']:.2e}"]
         for r in records(path)))


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--hf", default=None, help="HF Qwen3-MoE / Qwen2-MoE folder (default: the "
                    "moe workload's seeded init)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default=None)
    ap.add_argument("--table", default=None, metavar="JSONL",
                    help="print the markdown table of a results file and exit")
    args = ap.parse_args()
    if print_table(args, table=table):
        return
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from megagrpo.config.model import ParallelConfig
    from megagrpo.data import encode_prompt
    from megagrpo.runtime.distributed import init_distributed
    from megagrpo.tasks import build_task

    init_distributed(ParallelConfig())
    w = get_workload("moe")
    cfg = base_config(w, "float32")
    task = build_task(cfg.data, cfg.arithmetic)
    prompts = [encode_prompt(task.tokenizer, task.train[i].prompt) for i in range(args.prompts)]
    for dtype in args.dtypes.split(","):
        hf = Path(args.hf) if args.hf else ensure_init(w, dtype)
        emit(measure(hf, dtype, prompts, args.group, args.max_tokens, 1.0, cfg.run.seed),
             args.out)


if __name__ == "__main__":
    main()
