"""The planner's arithmetic: per-rank bytes of a recipe at a TP/PP layout, and the layouts that
fit a GPU budget. Pure arithmetic on the config; it starts nothing and needs no GPU (the report
is `megagrpo.plan.run_plan`).

What is counted, per rank, on the worst pipeline stage:
- policy weights: local parameters x dtype bytes. Local = TP-split matrices (QKV, proj, fc1,
  fc2, the padded vocab of embedding/output layer) plus replicated norms; the embedding lives on
  the first stage, the final norm and output layer on the last (with tied embeddings and PP > 1
  the last stage holds its own copy, as megatron does).
- grads: megatron DDP keeps fp32 grad buffers (`grad_reduce_in_fp32`): 4 bytes/param.
- optimizer: Adam m and v in fp32 (8 bytes/param) plus an fp32 master copy when the params are
  bf16/fp16 (4 more); the distributed optimizer divides these by DP.
- reference weights: same shard as the policy; 0 when algo.beta = 0 (no reference is built) or
  reference.offload (resident in CPU memory between scoring passes).
- LoRA (lora.rank > 0): weights + the adapters; grads and optimizer for the adapters only
  (`LoRAConfig.rank_numel`); no reference weights (the reference is the adapters off).
- logits: with the fused output layer (compute.fused_output_layer, on by default) no logits
  tensor exists: one GPU chunk [Tc, Vc] of logits in the model dtype (kernels/fused_output.py's
  `chunk_shape`; the gradient overwrites it), below fp32 the fp32 accumulators of dh [T, h] and
  of one dW chunk [Vc, h], and the fp32 per-row stats; where the update computes the gradient
  in the forward (`use_grad_in_forward`: large T) one [Tc, V/tp] chunk instead, with dh and the
  whole shard's dW held from forward to backward (fp32 below an fp32 model). With it off, the
  fused kernels read the vocab-parallel logits [T, V_pad/tp] in the model dtype and write the
  gradient into the same buffer (compute.inplace_backward), plus the stats. Either is shown
  next to a naive path that all-gathers [T, V] and runs an fp32 log_softmax (upcast copy,
  saved output and its gradient: 3 fp32 [T, V] tensors). T = compute.micro_batch_size x
  rollout.max_model_len (the longest padded micro-batch).
- activations: per layer, what megagrpo's SwiGLU / GQA layers save for backward on the local
  spec (`layer_values`, counted from autograd's saved tensors on CPU: the norms' inputs and
  outputs, the linears' inputs, RoPE's tables, q, k, the fused QKV output the V view keeps,
  the attention output and log-sum-exp, SwiGLU's 5 x FFN; Korthikanti et al. 2022's formula,
  which assumes MHA and a 4h GeLU MLP, was 29-36% under it), heads, KV groups and FFN / tp,
  the norms' part / tp with sequence parallelism, plus a*s^2*b/tp where the attention scores
  are materialised (the softmax output; only the local spec with
  parallel.attention_impl=megatron keeps scores, SDPA and TE none), times layers
  per stage, times the pp micro-batches the first stage holds under 1F1B. compute.recompute:
  selective keeps the core attention's inputs and output, its own tensors (scores, lse, CP's
  gathered K/V) for one layer in backward; full keeps each layer's input (s*b*h values, /tp
  with sequence parallelism) plus one recomputed chunk (compute.recompute_num_layers layers) of
  one micro-batch. s = rollout.max_model_len, b = compute.micro_batch_size. With context
  parallelism (parallel.cp = c) s is one rank's share of the row (its 2 of 2c chunks), and the
  CP attention saves q, its output and lse for the rank's tokens and the K and V all-gathered
  over the row, 2 x c s b x KV heads x head_dim / tp values a layer, instead of the rank's own
  K and fused QKV output (no mask: its causal structure is blocks,
  `megagrpo.parallel.context_parallel.causal_chunk_attention`). The logits path counts the rank's
  tokens (T / c). Measured against CPU peaks by benchmarks/recompute_memory.py
  (docs/performance.md, docs/context-parallel.md).
- vLLM: colocated in every rank, in engines of k = rollout.tensor_parallel_size ranks, so each
  rank holds 1/k of the model in rollout.dtype (vocab and matrices split, norms replicated) and
  the KV cache of ceil(KV heads / k) heads per layer (vLLM replicates KV heads when k exceeds
  them). It takes rollout.gpu_memory_utilization of the GPU while it samples (weights + KV
  cache), next to the training state (weights, grads, optimizer, resident reference), and keeps
  it through the update unless rollout.sleep_between_rollouts frees it. The peak is the larger
  of the rollout phase (training state + vLLM) and the update phase (training state + logits +
  activations, + vLLM when it does not sleep). KV cache = vLLM's share minus its weights; the
  recommended k is the smallest valid one whose KV cache holds one group (algo.group_size
  sequences of rollout.max_model_len tokens).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from megagrpo.config.layout import check_rollout_layout
from megagrpo.config.model import ModelConfig, ParallelConfig
from megagrpo.config.params import (
    embedding_specs,
    head_specs,
    layer_specs,
    rank_numel,
    split_numels,
    stage_layers,
    vision_specs,
)
from megagrpo.config.seqpar import sequence_parallel_auto
from megagrpo.config.train import TrainConfig

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MAX_TP = 8  # tensor parallelism stays inside one node (NVLink); more GPUs go to PP and DP


# ------------------------------------------------------------------------ parameter counts
# Every count is derived from the one parameter layout (`megagrpo.config.params`): the TP-split
# parameters' total / tp plus the replicated ones, per layer as megatron holds them.
def layer_params(m: ModelConfig, tp: int = 1, layer: int = 0, ep: int = 1, *,
                 active: bool = False) -> int:
    """Parameters of transformer layer `layer` on one TP x EP rank (tp=ep=1: the whole layer;
    `active`: the parameters one token runs through, i.e. k of the E routed experts)."""
    if not active:
        return rank_numel(layer_specs(m, layer, 0, ep=ep, ep_rank=0), tp)
    # one expert per EP rank: EP rank 0's specs hold exactly one routed expert
    specs = layer_specs(m, layer, 0, ep=max(1, m.num_experts), ep_rank=0)
    split, replicated = split_numels(s for s in specs if s.ep_owner is None)
    expert, _ = split_numels(s for s in specs if s.ep_owner is not None)
    return (split + m.moe_topk * expert) // tp + replicated


def expert_params(m: ModelConfig, tp: int = 1, ep: int = 1, layers: range | None = None) -> int:
    """Routed-expert parameters on one TP x EP rank over `layers` (default: all)."""
    moe = [g for g in (layers or range(m.num_layers)) if m.is_moe_layer(g)]
    if not moe:
        return 0
    # every MoE layer holds the same routed experts: count one, times the MoE layers
    routed = [s for s in layer_specs(m, moe[0], 0, ep=ep, ep_rank=0) if s.ep_owner is not None]
    return rank_numel(routed, tp) * len(moe)


def total_params(m: ModelConfig, *, active: bool = False) -> int:
    """Parameter count as Hugging Face reports it (unpadded vocab, one tied embedding);
    `active`: per token (k of the E routed experts)."""
    whole = ParallelConfig()  # one stage: the embedding, the final norm, an untied output layer
    edges = embedding_specs(m, whole, 0) + head_specs(m, whole, 0)
    return (sum(math.prod(shape) for s in edges for _, shape in s.hf_tensors(m))
            + vision_params(m)
            + sum(layer_params(m, layer=i, active=active) for i in range(m.num_layers)))


def vision_params(m: ModelConfig) -> int:
    """A vision-language model's vision tower and merger (replicated: every TP rank holds all
    of them, on the first stage); 0 for text models."""
    return rank_numel(vision_specs(m), 1) if m.is_vlm else 0


def frozen_params(m: ModelConfig, stage: int) -> int:
    """Parameters of stage `stage` that hold no gradient and no optimizer state: the vision
    tower and merger when model.freeze_vision (first stage)."""
    return vision_params(m) if stage == 0 and m.is_vlm and m.freeze_vision else 0


def stage_params(m: ModelConfig, p: ParallelConfig, stage: int) -> int:
    """Parameters held by one rank of pipeline stage `stage` (0-based) at p.tp, p.pp, p.ep."""
    edges = embedding_specs(m, p, stage) + head_specs(m, p, stage)
    return (rank_numel(edges, p.tp) + (vision_params(m) if stage == 0 else 0)
            + sum(layer_params(m, p.tp, g, p.ep) for g in stage_layers(m, p, stage)))


def moe_dispatch_bytes(cfg: TrainConfig, m: ModelConfig, tp: int, pp: int) -> int:
    """Rough per-rank bytes the MoE layers keep for backward on the first stage (on top of the
    dense activation estimate): per MoE layer, the permuted tokens before and after the
    all-to-all (2 x [T k, H]; under sequence parallelism the first is this TP rank's slice,
    [T k / tp, H], the second the TP group's tokens gathered for the expert-TP shards) and
    the experts' SwiGLU intermediates (3 x [T k, F_e / tp]), for the pp micro-batches 1F1B
    holds; under compute.recompute=full only one recomputed chunk (recompute_num_layers
    layers of one micro-batch) holds them at a time. T is the micro-batch's tokens; routing
    balanced."""
    if not m.is_moe:
        return 0
    t = cfg.compute.micro_batch_size * cfg.rollout.max_model_len
    sp = sequence_parallel_auto(cfg, m, tp)[0]
    hidden = m.hidden_size + m.hidden_size // (tp if sp else 1)
    per_layer = t * m.moe_topk * (hidden + 3 * m.moe_ffn_hidden_size // tp)
    layers = sum(m.is_moe_layer(i) for i in range(m.num_layers)) // pp * pp
    if cfg.compute.recompute == "full":
        layers = min(cfg.compute.recompute_num_layers, layers)
    return per_layer * layers * DTYPE_BYTES[m.dtype]


# ------------------------------------------------------------------------ per-rank bytes
@dataclass(kw_only=True)
class RankMemory:
    """Bytes on the most loaded rank at one layout."""

    tp: int
    """Tensor-parallel size."""
    pp: int
    """Pipeline-parallel size."""
    dp: int
    """Data-parallel size (world // (tp * pp))."""
    params: int
    """Parameters on the most loaded stage's rank."""
    weights: int
    """Policy weights."""
    grads: int
    """fp32 gradient buffers."""
    optimizer: int
    """Adam moments (+ fp32 master copy), divided by dp with the distributed optimizer."""
    reference: int
    """Reference weights resident on the GPU."""
    logits_fused: int
    """Working set of the vocab pass: the fused output layer's chunks, or (with it off) the
    logits the fused vocab-parallel kernels read."""
    logits_naive: int
    """What a gathered fp32 log_softmax over [T, V] would need instead (not in the total)."""
    activations: int
    """Rough activation estimate (see the module docstring)."""
    vllm: int
    """vLLM's share of the GPU while it samples."""
    vllm_sleeps: bool
    """vLLM frees its share during the update (rollout.sleep_between_rollouts)."""
    optimizer_sharded: bool
    """The distributed optimizer shards the optimizer state over dp."""
    vllm_tp: int = 1
    """k = rollout.tensor_parallel_size: ranks per vLLM engine."""
    vllm_weights: int = 0
    """vLLM's weights on this rank (1/k of the model), inside its share."""
    kv_token_bytes: int = 0
    """KV cache bytes per token on this rank (all layers, K and V)."""
    fused_output: bool = True
    """The vocab pass runs in the fused output layer (compute.fused_output_layer)."""
    ep: int = 1
    """Expert-parallel size."""
    expert_params: int = 0
    """Routed-expert parameters on the most loaded stage's rank (part of `params`)."""
    moe_dispatch: int = 0
    """MoE all-to-all buffers and expert intermediates kept for backward (rough)."""

    @property
    def kv_cache(self) -> int:
        """What vLLM's share leaves for the KV cache after its weights (< 0: it cannot start)."""
        return self.vllm - self.vllm_weights

    @property
    def kv_tokens(self) -> int:
        """Tokens the KV cache holds (0 when it has no room)."""
        return max(0, self.kv_cache) // max(1, self.kv_token_bytes)

    @property
    def state(self) -> int:
        """Resident through the whole step: weights, grads, optimizer, reference."""
        return self.weights + self.grads + self.optimizer + self.reference

    @property
    def update_peak(self) -> int:
        return (self.state + self.logits_fused + self.activations + self.moe_dispatch
                + (0 if self.vllm_sleeps else self.vllm))

    @property
    def rollout_peak(self) -> int:
        return self.state + self.vllm

    @property
    def total(self) -> int:
        """Peak bytes of the step on this rank."""
        return max(self.update_peak, self.rollout_peak)


def logits_bytes(cfg: TrainConfig, m: ModelConfig, tp: int, tp_pad: ParallelConfig
                 ) -> tuple[int, int]:
    """(vocab pass, naive) working set in bytes for one micro-batch on one TP rank: the fused
    output layer's chunks, or the logits the fused kernels read (compute.fused_output_layer
    false)."""
    t = cfg.compute.micro_batch_size * cfg.rollout.max_model_len // tp_pad.cp  # per CP rank
    b = DTYPE_BYTES[m.dtype]
    v_local = tp_pad.padded_vocab_size(m.vocab_size) // tp
    # per-row fp32 stats [T, 4], their all-gather [tp * T, 4], and three [T] fp32 rows saved for
    # backward (max, log-sum-exp, shift)
    stats = t * 4 * (4 + 4 * tp + 3)
    naive = t * m.vocab_size * (b + 3 * 4)
    if cfg.compute.fused_output_layer is not False:
        return fused_output_bytes(t, m.hidden_size, v_local, b) + stats, naive
    buffers = 1 if cfg.compute.inplace_backward else 2  # logits (+ a separate gradient buffer)
    return buffers * t * v_local * b + stats, naive


def fused_output_bytes(t: int, h: int, v_local: int, b: int) -> int:
    """The fused output layer's buffers on a GPU beyond its inputs and outputs (see the module
    docstring), for the path the update takes at this size (`use_grad_in_forward`); `b` bytes
    per value of the model dtype. Recomputing path: one [Tc, Vc] chunk, and below fp32 the fp32
    dh [T, h] and dW-chunk [Vc, h] accumulators. Gradient-in-forward path: one [Tc, V/tp]
    chunk, dh [T, h] and dW [V/tp, h] held from forward to backward (fp32 accumulators; for an
    fp32 model they are the gradients themselves, which count once as outputs)."""
    from megagrpo.kernels.fused_output import (  # torch + triton: only when planning
        chunk_shape,
        grad_chunk_tokens,
        use_grad_in_forward,
    )

    tg = grad_chunk_tokens(t, v_local, cuda=True)
    if use_grad_in_forward(t, tg, h, b, cuda=True):
        held = (t * h + v_local * h) * 4 if b < 4 else 0
        return tg * v_local * b + held
    tc, vc = chunk_shape(t, v_local, cuda=True)
    accumulators = (t * h + vc * h) * 4 if b < 4 else 0
    return tc * vc * b + accumulators


def layer_values(m: ModelConfig, tp: int, sp: bool, cp: int, core_saved: bool) -> float:
    """Values a transformer layer saves for backward per token on this rank (megagrpo's
    SwiGLU / GQA Llama-family layers on the local spec with SDPA, counted from what autograd
    saves on CPU: benchmarks/recompute_memory.py), scores left out. `core_saved`: the core
    attention keeps its own tensors (not recomputed by compute.recompute=selective)."""
    h, d = m.hidden_size, m.head_dim
    a, g = m.num_attention_heads / tp, m.num_query_groups / tp
    # per norm block: the norm's input and normalised output (torch's RMSNorm), the linear's
    # input; + RoPE's cos and sin for q and k (fp32 [s, d] each, counted at the model's size)
    norms = 2 * 3 * h / (tp if sp else 1) + 4 * d
    f = (m.moe_topk * m.moe_ffn_hidden_size if m.is_moe and m.moe_ffn_hidden_size
         else m.ffn_hidden_size) / tp
    mlp = 5 * f  # SwiGLU: fc1's output [2f], silu's output and the gate [f each], fc2's input
    if core_saved and cp > 1:  # q, the output, the log-sum-exp; K and V gathered over the row
        attn = 2 * a * d + a + 2 * cp * g * d
    else:  # q and k (rotated), the fused QKV output (V is a view of it), the output (+ lse)
        attn = a * d + g * d + (a + 2 * g) * d + a * d + (a if core_saved else 0)
    return norms + attn + mlp


def activation_bytes(cfg: TrainConfig, m: ModelConfig, tp: int, pp: int) -> int:
    """Rough per-rank activations of the first stage's update pass, with sequence parallelism,
    context parallelism and compute.recompute (see the module docstring)."""
    p = cfg.parallel
    # s: this CP rank's tokens per row (its 2 x cp chunks of the row padded to 2 x cp)
    full_s, b, h = cfg.rollout.max_model_len, cfg.compute.micro_batch_size, m.hidden_size
    s = -(-full_s // (2 * p.cp)) * 2 if p.cp > 1 else full_s
    sp = sequence_parallel_auto(cfg, m, tp)[0]
    materialised = p.transformer_impl == "local" and p.attention_impl == "megatron"
    # the softmax output [b, a/tp, s, s] (megagrpo builds its models without attention dropout)
    scores = m.num_attention_heads * s * s * b / tp if materialised else 0.0
    layers = len(stage_layers(m, dataclasses.replace(p, pp=pp), 0))
    size = DTYPE_BYTES[m.dtype]
    full = s * b * layer_values(m, tp, sp, p.cp, core_saved=True) + scores
    rc = cfg.compute.recompute
    if rc == "full":  # each layer's input, + one recomputed chunk's activations in backward
        kept = s * b * h / (tp if sp else 1)
        chunk = min(cfg.compute.recompute_num_layers, layers)
        return int(size * (kept * layers * pp + full * chunk))
    if rc == "selective":  # the core attention's inputs and output kept, its own saved
        # tensors (scores, lse, CP's gathered K/V) for one layer at a time in backward
        part = s * b * layer_values(m, tp, sp, p.cp, core_saved=False)
        return int(size * (part * layers * pp + full - part))
    return int(size * full * layers * pp)


def vllm_rank_bytes(m: ModelConfig, k: int, dtype: str) -> tuple[int, int]:
    """(weights, KV cache bytes per token) of one rank of a vLLM engine of k ranks."""
    b = DTYPE_BYTES[dtype]
    norms = (2 * m.num_layers + 1) * m.hidden_size  # replicated on every rank
    weights = ((total_params(m) - norms) // k + norms) * b
    kv_heads = -(-m.num_query_groups // k)
    return weights, 2 * m.num_layers * kv_heads * m.head_dim * b


def rank_memory(cfg: TrainConfig, m: ModelConfig, tp: int, pp: int, world: int,
                gpu_mem_gib: float, vllm_tp: int | None = None) -> RankMemory:
    """Per-rank bytes of `cfg` with the model `m` laid out at tp x pp over `world` ranks of
    `gpu_mem_gib` GiB each, vLLM engines of `vllm_tp` ranks (default: the recipe's)."""
    k = vllm_tp or cfg.rollout.tensor_parallel_size
    vllm_weights, kv_token = vllm_rank_bytes(m, k, cfg.rollout.dtype)
    layout = dataclasses.replace(cfg.parallel, tp=tp, pp=pp)
    ep = layout.ep
    # DP x CP ranks hold the same weights; megatron's distributed optimizer shards over both
    dp = max(1, world // (tp * pp))
    stage = max(range(pp), key=lambda s: stage_params(m, layout, s))
    n = stage_params(m, layout, stage)
    n_expert = expert_params(m, tp, ep, stage_layers(m, layout, stage)) if m.is_moe else 0
    b = DTYPE_BYTES[m.dtype]
    opt_per_param = 8 + (4 if b < 4 else 0)
    trained = n - frozen_params(m, stage)  # a frozen vision tower: weights only
    optimizer = trained * opt_per_param
    if cfg.optim.distributed_optimizer:  # experts shard over their DP group (dp / ep ranks)
        optimizer = (-(-(trained - n_expert) * opt_per_param // dp)
                     + -(-n_expert * opt_per_param // max(1, dp // ep)))
    with_ref = cfg.algo.beta > 0 and not cfg.reference.offload
    grads, weights = trained * 4, n * b
    if cfg.lora.enabled:  # the base is frozen: grads and Adam for the adapters only, and the
        # reference is the adapters off (no copy)
        adapters = cfg.lora.rank_numel(m, tp, stage_layers(m, layout, stage), ep=ep)
        optimizer = adapters * opt_per_param
        if cfg.optim.distributed_optimizer:
            optimizer = -(-optimizer // dp)
        grads, weights, with_ref = adapters * 4, (n + adapters) * b, False
    fused, naive = logits_bytes(cfg, m, tp, layout)
    colocated = cfg.rollout.placement != "separate"
    vllm_weights = vllm_weights if colocated else 0
    return RankMemory(tp=tp, pp=pp, dp=max(1, dp // layout.cp), params=n, weights=weights,
                      grads=grads,
                      optimizer=optimizer, reference=n * b if with_ref else 0,
                      logits_fused=fused, logits_naive=naive,
                      activations=activation_bytes(cfg, m, tp, pp),
                      # separate placement: the engines live on rollout ranks of their own
                      vllm=int(cfg.rollout.gpu_memory_utilization * gpu_mem_gib * GIB)
                      if colocated else 0,
                      vllm_sleeps=cfg.rollout.sleep_between_rollouts,
                      optimizer_sharded=cfg.optim.distributed_optimizer,
                      vllm_tp=k, vllm_weights=vllm_weights, kv_token_bytes=kv_token,
                      fused_output=cfg.compute.fused_output_layer is not False,
                      ep=ep, expert_params=n_expert,
                      moe_dispatch=moe_dispatch_bytes(cfg, m, tp, pp))


def recommend_vllm_tp(cfg: TrainConfig, m: ModelConfig, world: int, gpu_mem_gib: float
                      ) -> int | None:
    """The smallest k that the layout check accepts (see `megagrpo.config.layout`) and whose
    KV cache holds one group: algo.group_size sequences of rollout.max_model_len tokens at
    once. None when no k does."""
    need = cfg.algo.group_size * cfg.rollout.max_model_len
    for k in range(1, world + 1):
        try:
            check_rollout_layout(k, cfg.parallel, m, world)
        except ValueError:
            continue
        r = rank_memory(cfg, m, cfg.parallel.tp, cfg.parallel.pp, world, gpu_mem_gib, k)
        if r.kv_tokens >= need:
            return k
    return None


def layouts(cfg: TrainConfig, m: ModelConfig, world: int) -> list[tuple[int, int]]:
    """Every (tp, pp) that validates for `m` over `world` ranks (tp <= MAX_TP)."""
    out = []
    for tp in range(1, min(MAX_TP, world) + 1):
        for pp in range(1, world // tp + 1):
            layout = dataclasses.replace(cfg.parallel, tp=tp, pp=pp)
            try:
                layout.validate(m, world)
            except ValueError:
                continue
            if cfg.data.batch_size % (world // (tp * pp)) == 0:
                out.append((tp, pp))
    return out


def suggest(cfg: TrainConfig, m: ModelConfig, world: int, gpu_mem_gib: float
            ) -> list[RankMemory]:
    """Layouts that fit, best first: most data parallelism (smallest tp*pp), then fewer
    pipeline stages (smaller bubble), then smaller tp."""
    fits = [r for tp, pp in layouts(cfg, m, world)
            if (r := rank_memory(cfg, m, tp, pp, world, gpu_mem_gib)).total <= gpu_mem_gib * GIB]
    return sorted(fits, key=lambda r: (r.tp * r.pp, r.pp, r.tp))


# ------------------------------------------------------------------------ the model
def plan_model(cfg: TrainConfig) -> tuple[ModelConfig, str]:
    """The architecture to plan for: run.init's config when it points at a checkpoint that is
    present, else the recipe's model section. Returns (model, where it came from)."""
    init = cfg.run.init
    p = Path(init).expanduser()
    if init != "random" and (p / "config.json").exists():
        from megagrpo.hf import model_config_from_hf

        return model_config_from_hf(p, dtype=cfg.model.dtype), f"{p / 'config.json'}"
    if init != "random" and (p / "megagrpo_model.json").exists():
        from megagrpo.checkpoint import read_model_config

        return read_model_config(p)[0], f"{p / 'megagrpo_model.json'}"
    note = "" if init == "random" else f"; run.init={init} is not on this machine"
    return cfg.model, "the recipe's model section" + note
