"""Cross-section rules and megatron-core fields of sequence parallelism and activation
recomputation (parallel.sequence_parallel, compute.recompute)."""
from __future__ import annotations

from megagrpo.config.model import ModelConfig, ParallelConfig


def check_recompute(compute, model: ModelConfig, parallel: ParallelConfig) -> None:
    """Refuses, before anything starts, the recomputation settings megatron-core's
    TransformerConfig would refuse at model build: full recomputation needs
    1 <= compute.recompute_num_layers <= the layers of a pipeline stage."""
    per_stage = parallel.stage_size(model.num_layers)
    if compute.recompute == "full" and not 1 <= compute.recompute_num_layers <= per_stage:
        raise ValueError(
            f"compute.recompute_num_layers={compute.recompute_num_layers}: full recomputation "
            f"takes 1..{per_stage} layers per chunk (model.num_layers={model.num_layers} / "
            f"parallel.pp={parallel.pp}); lower compute.recompute_num_layers")


def check_sequence_parallel(algo, parallel: ParallelConfig) -> None:
    """Refuses what sequence parallelism does not run yet: routing replay (each TP rank's
    router would need its slice of vLLM's routes; not checked end to end)."""
    if parallel.sequence_parallel and algo.routing_replay:
        raise ValueError("algo.routing_replay=true with parallel.sequence_parallel=true: replay "
                         "of vLLM's routes is not supported under sequence parallelism yet; "
                         "set one of them to false")


def sequence_parallel_auto(cfg, model: ModelConfig, tp: int | None = None) -> tuple[bool, str]:
    """parallel.sequence_parallel as a run at tensor-parallel size `tp` (default parallel.tp)
    takes it: (on, why). Set true/false: as set. Unset (None): on for mixture-of-experts
    models at tp > 1 (each TP rank dispatches its own tokens: no tp x expert compute, the aux
    and z-losses at full strength) unless a setting it does not run with is on; off for dense
    models, where it splits the norms' and residuals' activations over TP (memory) at the same
    communication volume but gained no speed (the midsize workload at TP=2, packed, with and
    without it on the CPU: benchmarks/results/dense_sp_packed_epyc_cpu.jsonl)."""
    p = cfg.parallel
    tp = p.tp if tp is None else tp
    if p.sequence_parallel is not None:
        return bool(p.sequence_parallel) and tp > 1, "parallel.sequence_parallel set"
    if tp == 1:
        return False, "auto: tp=1"
    if not model.is_moe:
        return False, ("auto: a dense model (sequence parallelism saves activation memory but "
                       "measured no faster; set parallel.sequence_parallel=true for the memory)")
    blockers = [(p.pp > 1, f"parallel.pp={p.pp}"), (p.cp > 1, f"parallel.cp={p.cp}"),
                (cfg.algo.routing_replay, "algo.routing_replay=true"),
                (cfg.compute.compile_layers is True, "compute.compile_layers=true")]
    off = [name for bad, name in blockers if bad]
    if off:
        return False, f"auto: a MoE model at tp={tp}, but {off[0]} does not run with it"
    return True, f"auto: a MoE model at tp={tp} (each TP rank routes its own tokens)"


def resolve_sequence_parallel(cfg, model: ModelConfig):
    """cfg.parallel with sequence_parallel decided (`sequence_parallel_auto`), and the reason."""
    import dataclasses

    on, why = sequence_parallel_auto(cfg, model)
    return dataclasses.replace(cfg.parallel, sequence_parallel=on), why


def recompute_fields(recompute: str, num_layers: int = 1) -> dict:
    """megatron-core TransformerConfig fields for compute.recompute ('none' | 'selective' |
    'full'): selective recomputes each layer's core attention (megatron's default module);
    full recomputes whole layers, `num_layers` per uniformly divided chunk."""
    if recompute == "none":
        return {}
    if recompute == "selective":
        return dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    if recompute == "full":
        return dict(recompute_granularity="full", recompute_method="uniform",
                    recompute_num_layers=num_layers)
    raise ValueError(f"compute.recompute={recompute!r}: use none, selective or full")


def megatron_aux_loss_coeff(model: ModelConfig) -> float:
    """megatron's per-layer load-balancing coefficient for HF's `router_aux_loss_coef`
    (model.moe_aux_loss_coef).

    HF (Qwen2/3-MoE) computes ONE switch loss over the router logits of all L MoE layers
    concatenated, E * sum_i f_i P_i with f_i the share of (token, layer) rows routing to expert
    i over all k slots (sum_i f_i = k); megatron adds a loss per MoE layer,
    E * sum_i f_i P_i with f_i divided by k (sum_i f_i = 1). For routing alike in every layer
    the HF loss's gradient on one layer's router is coef / L times the per-layer term's,
    megatron's coeff / k times it: coeff = coef * k / L gives each router HF's gradient."""
    layers = sum(model.moe_layer_pattern)
    return model.moe_aux_loss_coef * model.moe_topk / max(layers, 1)
