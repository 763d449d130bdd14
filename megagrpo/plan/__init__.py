"""Memory/parallelism planner (`megagrpo plan`): per-rank bytes of a recipe at a TP/PP layout,
and the layouts that fit a GPU budget. Pure arithmetic on the config; it starts nothing and needs
no GPU.

    python -m megagrpo plan --config examples/llama3-8b-math.yaml --gpus 16 --gpu-mem-gib 80

- `memory`: what one rank holds (weights, gradients, optimizer, reference, logits, activations,
  vLLM) and the layouts that fit; the whole count is in its docstring;
- `lora`: a LoRA recipe next to full fine-tuning of the same recipe (refit bytes, state);
- `placement`: separate placement's rollout ranks;
- `reward`: a reward_model source's weights and activations beside vLLM;
- here: the report (`run_plan`).
"""
from __future__ import annotations

from megagrpo.config.model import ModelConfig
from megagrpo.config.params import stage_layers
from megagrpo.config.seqpar import megatron_aux_loss_coeff
from megagrpo.config.train import TrainConfig, load_config
from megagrpo.plan.memory import (
    DTYPE_BYTES,
    GIB,
    MAX_TP,
    RankMemory,
    activation_bytes,
    expert_params,
    fused_output_bytes,
    layer_params,
    layer_values,
    layouts,
    logits_bytes,
    moe_dispatch_bytes,
    plan_model,
    rank_memory,
    recommend_vllm_tp,
    stage_params,
    suggest,
    total_params,
    vllm_rank_bytes,
)


def _gib(n: float) -> str:
    return f"{n / GIB:9.3f}"


def format_breakdown(r: RankMemory, m: ModelConfig, gpu_mem_gib: float) -> str:
    """The component table of one layout."""
    master = " + fp32 master" if DTYPE_BYTES[m.dtype] < 4 else ""
    rows = [
        (f"policy weights ({m.dtype})", r.weights),
        ("grads (fp32 buffers)", r.grads),
        (f"Adam m, v{master}" + (" (/dp)" if r.optimizer_sharded else ""), r.optimizer),
        ("reference weights (resident)", r.reference),
        (("logits, fused output layer: chunks, no [T, V/tp] (update)" if r.fused_output else
          "logits, fused kernels [T, V/tp] (update)"), r.logits_fused),
        ("activations, rough estimate (update)", r.activations),
        *([("MoE all-to-all buffers + expert intermediates (update)", r.moe_dispatch)]
          if r.moe_dispatch else []),
        ("vLLM share (rollout" + ("" if r.vllm_sleeps else " and update") + ")", r.vllm),
        (f"  of which vLLM weights (1/{r.vllm_tp} of the model)", r.vllm_weights),
        ("  of which KV cache", r.kv_cache),
    ]
    experts = (f", {r.expert_params / 1e6:.1f}M of them routed experts" if r.expert_params
               else "")
    lines = [(f"per-rank memory at tp={r.tp} pp={r.pp} dp={r.dp}"
              + (f" ep={r.ep}" if r.ep > 1 else "")
              + f" ({r.params / 1e6:.1f}M params on the most loaded rank{experts})"),
             f"  {'component':<56}{'GiB':>9}"]
    lines += [f"  {name:<56}{_gib(v)}" for name, v in rows]
    lines += [f"  {'peak during rollout':<56}{_gib(r.rollout_peak)}",
              f"  {'peak during update':<56}{_gib(r.update_peak)}",
              f"  {'GPU memory':<56}{gpu_mem_gib:9.3f}",
              (f"  {'(a naive fp32 log_softmax over [T, V] would need)':<56}"
              f"{_gib(r.logits_naive)}")]
    return "\n".join(lines)


def format_experts(cfg: TrainConfig, m: ModelConfig, world: int) -> str:
    """The MoE lines: routing, and routed-expert weights per rank at each valid EP."""
    moe_layers = sum(m.is_moe_layer(i) for i in range(m.num_layers))
    shared = (f", a gated shared expert of width {m.shared_expert_ffn_hidden_size}"
              if m.shared_expert_ffn_hidden_size else "")
    lines = [f"experts: {m.num_experts} routed of width {m.moe_ffn_hidden_size}, top-"
             f"{m.moe_topk}{'' if m.moe_norm_topk_prob else ' (not renormalised)'}, in "
             f"{moe_layers} of {m.num_layers} layers{shared}; aux loss coef "
             f"{m.moe_aux_loss_coef:g} (HF's; megatron per layer: "
             f"{megatron_aux_loss_coeff(m):g})"]
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    dp = max(1, world // (tp * pp))
    b = DTYPE_BYTES[m.dtype]
    first_stage = stage_layers(m, cfg.parallel, 0)
    for ep in (e for e in range(1, dp + 1) if dp % e == 0 and m.num_experts % e == 0):
        n = expert_params(m, tp, ep, first_stage)
        mark = "  <- parallel.ep" if ep == cfg.parallel.ep else ""
        lines.append(f"  ep={ep:<3} {m.num_experts // ep:>4} experts per rank: routed-expert "
                     f"weights {n * b / GIB:8.3f} GiB per rank (tp={tp}, pp={pp}){mark}")
    return "\n".join(lines) + "\n"


def format_candidates(cands: list[RankMemory]) -> str:
    """One line per layout."""
    lines = [f"  {'tp':>3} {'pp':>3} {'dp':>4} {'peak GiB':>9}"]
    lines += [f"  {r.tp:>3} {r.pp:>3} {r.dp:>4} {_gib(r.total)}" for r in cands]
    return "\n".join(lines)


def _print_vllm(cfg: TrainConfig, m: ModelConfig, r: RankMemory, world: int,
                gpu_mem_gib: float) -> None:
    """The rollout side: KV cache room at the recipe's k and the recommended k."""
    seqs = r.kv_tokens // cfg.rollout.max_model_len
    print(f"  vLLM engines of {r.vllm_tp} rank(s): KV cache {r.kv_cache / GIB:.2f} GiB per rank"
          f" = {r.kv_tokens} tokens ({seqs} sequences of {cfg.rollout.max_model_len} at once)")
    best = recommend_vllm_tp(cfg, m, world, gpu_mem_gib)
    if best is None:
        print("  no rollout.tensor_parallel_size gives vLLM room for one group's KV cache: "
              "raise rollout.gpu_memory_utilization or lower rollout.max_model_len")
    else:
        tp = cfg.parallel.tp
        print(f"  recommended rollout.tensor_parallel_size={best} (smallest k whose KV cache "
              f"holds {cfg.algo.group_size} sequences of {cfg.rollout.max_model_len} tokens)"
              + ("" if best == tp else f"; k = parallel.tp = {tp} refreshes shard to shard"))


def run_plan(config: str | None, overrides: list[str], *, gpus: int = 0,
             gpu_mem_gib: float = 80.0) -> int:
    """`python -m megagrpo plan`: prints the breakdown at the recipe's layout and the layouts
    that fit. Returns 0 when the recipe's layout fits, 1 when it does not."""
    cfg = load_config(config, overrides)
    m, source = plan_model(cfg)
    m.validate()
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    separate = cfg.rollout.placement == "separate"
    world = (gpus - cfg.rollout.rollout_ranks if gpus and separate else gpus) or tp * pp
    rope = "" if m.rope_type == "default" else f" ({m.rope_type} RoPE x{m.rope_factor:g})"
    active = (f" ({total_params(m, active=True) / 1e6:.1f}M active per token)" if m.is_moe
              else "")
    print(f"model from {source}: {m.architecture}{rope}, {total_params(m) / 1e6:.1f}M params"
          f"{active}; "
          f"L={m.num_layers} H={m.hidden_size} F={m.ffn_hidden_size} "
          f"heads={m.num_attention_heads}/{m.num_query_groups} V={m.vocab_size} "
          f"(padded {cfg.parallel.padded_vocab_size(m.vocab_size)} at tp={tp}), {m.dtype}")
    print(f"world: {world} GPU(s) x {gpu_mem_gib:g} GiB; T = {cfg.compute.micro_batch_size} x "
          f"{cfg.rollout.max_model_len} tokens per micro-batch\n")
    if m.is_moe:
        print(format_experts(cfg, m, world))
    current = rank_memory(cfg, m, tp, pp, world, gpu_mem_gib)
    print(format_breakdown(current, m, gpu_mem_gib))
    try:
        cfg.parallel.validate(m, world)
        print(f"  fits: {'yes' if current.total <= gpu_mem_gib * GIB else 'no'}")
    except ValueError as e:
        print(f"  note: the recipe's layout does not validate: {e}")
    if separate:
        from megagrpo.plan.placement import format_separate

        print(format_separate(cfg, m, current, world, gpu_mem_gib))
    else:
        _print_vllm(cfg, m, current, world, gpu_mem_gib)
    from megagrpo.plan.reward import format_reward_models

    reward_text, reward_bytes = format_reward_models(cfg)
    if reward_text:
        print(reward_text)
    if reward_bytes:
        peak = current.total + reward_bytes
        print(f"  with the reward model: {peak / GIB:.2f} GiB on an engine's leader rank; "
              f"fits: {'yes' if peak <= gpu_mem_gib * GIB else 'no'}")
    if cfg.lora.enabled:
        from megagrpo.plan.lora import format_lora_vs_full

        print("\n" + format_lora_vs_full(cfg, m, current, world, gpu_mem_gib))
    fits = suggest(cfg, m, world, gpu_mem_gib)
    if fits:
        best = fits[0]
        print(f"\nsuggested: parallel.tp={best.tp} parallel.pp={best.pp} (dp={best.dp}); "
              "layouts that fit, best first:")
        print(format_candidates(fits[:8]))
    else:
        print(f"\nno valid tp x pp over {world} GPU(s) fits {gpu_mem_gib:g} GiB: add GPUs or set "
              "optim.distributed_optimizer, reference.offload, rollout.sleep_between_rollouts, "
              "a lower rollout.gpu_memory_utilization or compute.micro_batch_size")
    if not gpus:  # planning for this machine: which dtype is faster on its CPU, measured
        import torch  # only once the memory plan is out (the planner starts nothing)

        from megagrpo.runtime.machine import dtype_advice

        if not torch.cuda.is_available():
            print("\n" + dtype_advice(params=total_params(m)))
    return 0 if current.total + reward_bytes <= gpu_mem_gib * GIB else 1


__all__ = ["DTYPE_BYTES", "GIB", "MAX_TP", "RankMemory", "activation_bytes", "expert_params",
           "format_breakdown", "format_candidates", "format_experts", "fused_output_bytes",
           "layer_params", "layer_values", "layouts", "logits_bytes", "moe_dispatch_bytes",
           "plan_model", "rank_memory", "recommend_vllm_tp", "run_plan", "stage_params", "suggest",
           "total_params", "vllm_rank_bytes"]
