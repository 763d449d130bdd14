"""The model's parameter layout, written once. `param_specs` lists every megatron parameter of a
pipeline stage with the HF tensors it is made of, its unsharded shape and how tensor/expert
parallelism splits it (`ParamSpec`); `stage_layers` is the pipeline split. Derived from them:
- the HF checkpoint's tensors and shapes (`hf_shapes`: checked on load, by `verify`, `convert`),
- the names and shapes the vLLM weight feed accepts (`vllm_feed_shapes`, `megagrpo.engine`),
- loading and export (`megagrpo.hf.io`, `megagrpo.sync.source`), through the QKV interleave
  `qkv_rows`,
- the planner's per-rank parameter counts (`rank_numel`, `megagrpo.plan`).

Families: Llama, Qwen2 (QKV bias), Qwen3 (q_norm / k_norm <-> megatron's
`self_attention.q_layernorm` / `k_layernorm`, [head_dim] each, replicated), Qwen3-MoE and
Qwen2-MoE (router, routed experts over EP ranks, Qwen2-MoE's gated shared expert), Qwen2.5-VL
(the Qwen2 decoder under the same HF names, plus the vision tower and merger: HF `visual.*` <->
megatron `vision.*`, every tensor replicated on every TP rank, held by the first stage).

Layouts (weights are [out, in]; see ../shared/FINDINGS.md):
- ``linear_qkv`` is fused per KV group g: [q heads of g, k_g, v_g]; TP splits whole groups.
- ``linear_fc1`` is cat(gate, up); TP rank r holds cat(gate_r, up_r).
- ``linear_proj`` / ``linear_fc2`` split the input dim; embeddings / output layer split the
  (padded) vocab; norms, routers and the shared-expert gate are replicated.

No torch here: the planner (run by the launcher) imports it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from megagrpo.config.model import ModelConfig, ParallelConfig


# ---------------------------------------------------------------- the specs
@dataclass(frozen=True)
class ParamSpec:
    """One megatron parameter of one pipeline stage and the HF tensors it is made of."""

    local: str
    """Name inside the stage's GPTModel (layer indices are stage-local)."""
    kind: str
    """vocab | qkv | gate_up | row | replicated."""
    hf: tuple[str, ...]
    """HF tensor names (global layer indices); qkv: (q, k, v), gate_up: (gate, up)."""
    full_shape: tuple[int, ...]
    """Unsharded megatron shape (vocab padded)."""
    ep_owner: int | None = None
    """Routed-expert parameters: the expert-parallel rank that holds it (`local` is its name
    there); None for every other parameter (held by every EP rank)."""

    @property
    def split_dim(self) -> int | None:
        return {"vocab": 0, "qkv": 0, "gate_up": 0, "row": 1}.get(self.kind)

    @property
    def numel(self) -> int:
        """Elements of the unsharded parameter."""
        return math.prod(self.full_shape)

    def local_shape(self, tp: int) -> tuple[int, ...]:
        s = list(self.full_shape)
        if self.split_dim is not None:
            s[self.split_dim] //= tp
        return tuple(s)

    def hf_tensors(self, model: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of each HF tensor this parameter is made of: q [nh*hd, ...] and k, v
        [ng*hd, ...] of a fused QKV, gate and up [F, H] of fc1, the vocab unpadded [V, H]."""
        rest = self.full_shape[1:]
        if self.kind == "vocab":
            return [(self.hf[0], (model.vocab_size, *rest))]
        if self.kind == "gate_up":
            return [(name, (self.full_shape[0] // 2, *rest)) for name in self.hf]
        if self.kind == "qkv":
            kv = model.num_query_groups * model.head_dim
            rows = (model.num_attention_heads * model.head_dim, kv, kv)
            return [(name, (n, *rest)) for name, n in zip(self.hf, rows)]
        return [(self.hf[0], self.full_shape)]


def qkv_rows(model: ModelConfig) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """The QKV interleave, written once: megatron's fused ``linear_qkv`` holds, for each KV group
    g in turn, a block of nh/ng * hd q rows (the q heads of g), then hd k rows and hd v rows.
    Returns the [start, stop) rows of q, k and v inside one group's block (whose size is the
    last stop). HF's q, k, v are the concatenation of those row ranges over the groups."""
    hd = model.head_dim
    q = model.num_attention_heads // model.num_query_groups * hd
    return (0, q), (q, q + hd), (q + hd, q + 2 * hd)


def stage_layers(model: ModelConfig, parallel: ParallelConfig, stage: int) -> range:
    """Global indices of the layers pipeline stage `stage` holds: megatron-core's even split
    (`ParallelConfig.validate` checks that pp divides num_layers); the stage's layer i is
    global layer stage * L/pp + i."""
    per = parallel.stage_size(model.num_layers)
    return range(stage * per, (stage + 1) * per)


def param_specs(model: ModelConfig, parallel: ParallelConfig, pp_rank: int,
                impl: str = "local", ep_rank: int | None = None) -> list[ParamSpec]:
    """The parameters stage `pp_rank` holds, in a fixed order every rank agrees on.
    `impl` is the layer spec ('local' or 'transformer_engine': norms fused into linears).
    Routed experts: those of expert-parallel rank `ep_rank` only, or, with None, every EP
    rank's (each spec's `ep_owner` says whose)."""
    out = embedding_specs(model, parallel, pp_rank)
    if model.is_vlm and pp_rank == 0:
        out += vision_specs(model)
    for i, g in enumerate(stage_layers(model, parallel, pp_rank)):
        out += layer_specs(model, g, i, ep=parallel.ep, ep_rank=ep_rank, impl=impl)
    return out + head_specs(model, parallel, pp_rank)


def embedding_specs(model: ModelConfig, parallel: ParallelConfig, pp_rank: int
                    ) -> list[ParamSpec]:
    """The word embeddings [V_pad, H] on the first stage; nothing on the others."""
    if pp_rank != 0:
        return []
    vp = parallel.padded_vocab_size(model.vocab_size)
    return [ParamSpec("embedding.word_embeddings.weight", "vocab",
                      ("model.embed_tokens.weight",), (vp, model.hidden_size))]


def vision_specs(model: ModelConfig) -> list[ParamSpec]:
    """Qwen2.5-VL's vision tower and merger, replicated (`megagrpo.model.vlm` builds them on
    every TP rank): the Conv3d patch embedding [h, C, t, p, p], per block two RMSNorms, the
    fused QKV [3h, h] (HF's own q, k, v order: kept as it is) and the output projection with
    biases, the SwiGLU MLP with biases; the merger's RMSNorm and its 2-layer MLP over
    spatial_merge_size^2 patches."""
    v = model.vision
    h, inner, m = v.hidden_size, v.intermediate_size, v.hidden_size * v.spatial_merge_size ** 2
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("patch_embed.proj.weight",
         (h, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size))]
    for b in range(v.depth):
        B = f"blocks.{b}."
        shapes += [(B + "norm1.weight", (h,)), (B + "norm2.weight", (h,)),
                   (B + "attn.qkv.weight", (3 * h, h)), (B + "attn.qkv.bias", (3 * h,)),
                   (B + "attn.proj.weight", (h, h)), (B + "attn.proj.bias", (h,))]
        for name, shape in (("gate_proj", (inner, h)), ("up_proj", (inner, h)),
                            ("down_proj", (h, inner))):
            shapes += [(f"{B}mlp.{name}.weight", shape), (f"{B}mlp.{name}.bias", shape[:1])]
    shapes += [("merger.ln_q.weight", (h,)), ("merger.mlp.0.weight", (m, m)),
               ("merger.mlp.0.bias", (m,)), ("merger.mlp.2.weight", (v.out_hidden_size, m)),
               ("merger.mlp.2.bias", (v.out_hidden_size,))]
    return [ParamSpec(VISION_PREFIX + name, "replicated", ("visual." + name,), shape)
            for name, shape in shapes]


VISION_PREFIX = "vision."
"""Where the vision tower sits inside megagrpo's VLM module (`megagrpo.model.vlm`)."""


def head_specs(model: ModelConfig, parallel: ParallelConfig, pp_rank: int) -> list[ParamSpec]:
    """The final norm and the output layer on the last stage; nothing on the others. With tied
    embeddings the output layer is the embedding itself on a single stage, and the last stage's
    own copy of it under PP (as megatron keeps; exported once, from stage 0)."""
    if pp_rank != parallel.pp - 1:
        return []
    H, vp = model.hidden_size, parallel.padded_vocab_size(model.vocab_size)
    out = [ParamSpec("decoder.final_layernorm.weight", "replicated", ("model.norm.weight",),
                     (H,))]
    if not model.tie_word_embeddings:
        out.append(ParamSpec("output_layer.weight", "vocab", ("lm_head.weight",), (vp, H)))
    elif parallel.pp > 1:
        out.append(ParamSpec("output_layer.weight", "vocab", ("model.embed_tokens.weight",),
                             (vp, H)))
    return out


def layer_specs(model: ModelConfig, layer: int, local: int, *, ep: int = 1,
                ep_rank: int | None = None, impl: str = "local") -> list[ParamSpec]:
    """Global layer `layer`, which its stage holds as layer `local`: attention, then the MLP
    (an MoE layer's routed experts over `ep` expert-parallel ranks, see `param_specs`)."""
    H, hd = model.hidden_size, model.head_dim
    nh, ng = model.num_attention_heads, model.num_query_groups
    te = impl == "transformer_engine"
    L, hf = f"decoder.layers.{local}.", f"model.layers.{layer}."
    attn = hf + "self_attn."
    fused = ng * qkv_rows(model)[-1][1]  # every KV group's block
    out = [ParamSpec(L + ("self_attention.linear_qkv.layer_norm_weight" if te
                          else "input_layernorm.weight"),
                     "replicated", (hf + "input_layernorm.weight",), (H,)),
           ParamSpec(L + "self_attention.linear_qkv.weight", "qkv",
                     (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
                     (fused, H))]
    if model.qkv_bias:
        out.append(ParamSpec(L + "self_attention.linear_qkv.bias", "qkv",
                             (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"),
                             (fused,)))
    if model.qk_norm:  # per-head RMSNorm weights: [head_dim], the same on every TP rank
        out.append(ParamSpec(L + "self_attention.q_layernorm.weight", "replicated",
                             (attn + "q_norm.weight",), (hd,)))
        out.append(ParamSpec(L + "self_attention.k_layernorm.weight", "replicated",
                             (attn + "k_norm.weight",), (hd,)))
    out.append(ParamSpec(L + "self_attention.linear_proj.weight", "row",
                         (attn + "o_proj.weight",), (H, nh * hd)))
    if model.is_moe_layer(layer):
        return out + _moe_specs(model, ep, L, hf, ep_rank)
    out.append(ParamSpec(L + ("mlp.linear_fc1.layer_norm_weight" if te
                              else "pre_mlp_layernorm.weight"),
                         "replicated", (hf + "post_attention_layernorm.weight",), (H,)))
    return out + _mlp_specs(L + "mlp.", hf + "mlp.", H, model.ffn_hidden_size)


def _mlp_specs(local: str, hf: str, H: int, F: int, ep_owner: int | None = None
               ) -> list[ParamSpec]:
    """A SwiGLU MLP: megatron's fused gate/up fc1 and fc2 <-> HF gate/up/down_proj."""
    return [ParamSpec(local + "linear_fc1.weight", "gate_up",
                      (hf + "gate_proj.weight", hf + "up_proj.weight"), (2 * F, H), ep_owner),
            ParamSpec(local + "linear_fc2.weight", "row", (hf + "down_proj.weight",), (H, F),
                      ep_owner)]


def _moe_specs(model: ModelConfig, ep: int, L: str, hf: str, ep_rank: int | None
               ) -> list[ParamSpec]:
    """An MoE layer's MLP part: the norm before it (never fused into a linear: the router reads
    it too), the router <-> HF `mlp.gate`, routed expert x = local expert x % (E/ep) of EP rank
    x // (E/ep), and Qwen2-MoE's shared expert with its sigmoid gate [1, H]."""
    H, E = model.hidden_size, model.num_experts
    per_rank = E // ep
    out = [ParamSpec(L + "pre_mlp_layernorm.weight", "replicated",
                     (hf + "post_attention_layernorm.weight",), (H,)),
           ParamSpec(L + "mlp.router.weight", "replicated", (hf + "mlp.gate.weight",), (E, H))]
    for x in range(E if per_rank else 0):  # ep > E (an invalid layout): no rank holds one
        owner = x // per_rank
        if ep_rank is None or owner == ep_rank:
            out += _mlp_specs(f"{L}mlp.experts.local_experts.{x % per_rank}.",
                              f"{hf}mlp.experts.{x}.", H, model.moe_ffn_hidden_size, owner)
    if model.shared_expert_ffn_hidden_size:
        out += _mlp_specs(L + "mlp.shared_experts.", hf + "mlp.shared_expert.", H,
                          model.shared_expert_ffn_hidden_size)
        out.append(ParamSpec(L + "mlp.shared_experts.gate_weight", "replicated",
                             (hf + "mlp.shared_expert_gate.weight",), (1, H)))
    return out


# ---------------------------------------------------------------- LoRA's view of the specs
ADAPTED = {"linear_qkv.weight": "qkv", "linear_proj.weight": "proj",
           "linear_fc1.weight": "fc1", "linear_fc2.weight": "fc2"}
"""The megatron weights an adapter can sit beside, by the end of their name, and their LoRA
target (lora.targets): every MLP's fc1 / fc2 counts, an MoE layer's routed and shared experts'
included."""


def lora_target(spec: ParamSpec) -> str | None:
    """The LoRA target (qkv, proj, fc1, fc2) whose adapter sits beside `spec`, else None."""
    return next((t for end, t in ADAPTED.items() if spec.local.endswith(end)), None)


def adapted(specs: Iterable[ParamSpec], targets: Iterable[str]) -> list[ParamSpec]:
    """The specs of `specs` that get an adapter under lora.targets = `targets`."""
    chosen = set(targets)
    return [s for s in specs if lora_target(s) in chosen]


def adapter_numel(spec: ParamSpec, rank: int, tp: int) -> int:
    """Elements of the adapter beside `spec` that one TP rank holds: A [r, in] and B [out, r]
    of the unsharded [out, in] weight, split as the weight is (column-parallel qkv / fc1: B's
    rows; row-parallel proj / fc2: A's columns); routed experts are not TP-split."""
    t = 1 if spec.ep_owner is not None else tp
    out, inp = spec.full_shape
    if spec.split_dim == 1:
        return rank * inp // t + out * rank
    return rank * inp + out // t * rank


def peft_modules(specs: Iterable[ParamSpec], model: ModelConfig) -> list[tuple[str, int, int]]:
    """(HF module name, in, out) of every HF projection the adapted `specs` are made of: peft's
    layout, one A [r, in] and B [out, r] per projection (the fused QKV and gate/up split into
    q/k/v and gate/up)."""
    return [(name.removesuffix(".weight"), shape[1], shape[0])
            for s in specs for name, shape in s.hf_tensors(model)]


# ---------------------------------------------------------------- derived from the specs
def hf_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Expected shape of every tensor in an HF checkpoint of this model: the HF tensors of
    the specs of one stage holding the whole model and every expert."""
    specs = param_specs(model, ParallelConfig(), 0)
    return {name: shape for s in specs for name, shape in s.hf_tensors(model)}


def vllm_feed_shapes(model: ModelConfig) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """(required, optional) HF names and shapes a vLLM engine of this model accepts in a weight
    update: the checkpoint's tensors, and with tied embeddings `lm_head.weight` [V, H] as an
    optional extra (vLLM reuses the embedding; transformers' state dict lists it)."""
    shapes = hf_shapes(model)
    if not model.tie_word_embeddings:
        return shapes, set()
    shapes["lm_head.weight"] = (model.vocab_size, model.hidden_size)
    return shapes, {"lm_head.weight"}


def rank_numel(specs: Iterable[ParamSpec], tp: int) -> int:
    """Elements one TP rank holds of `specs`: the TP-split parameters' total / tp plus the
    replicated ones (the sum of the `local_shape(tp)` sizes wherever tp divides each split dim,
    as a validated layout ensures)."""
    split, replicated = split_numels(specs)
    return split // tp + replicated


def split_numels(specs: Iterable[ParamSpec]) -> tuple[int, int]:
    """(TP-split elements, replicated elements) of `specs`, unsharded."""
    split = replicated = 0
    for s in specs:
        if s.split_dim is None:
            replicated += s.numel
        else:
            split += s.numel
    return split, replicated
