"""Hugging Face interop: HF config <-> ModelConfig, HF tensor names <-> megatron shards.

Families: Llama (with default or llama3 RoPE), Qwen2 (QKV bias), Qwen3 (q_norm / k_norm <->
megatron's `self_attention.q_layernorm` / `k_layernorm`, [head_dim] each, replicated).

Layouts (weights are [out, in]; see ../shared/FINDINGS.md):
- ``linear_qkv`` is fused per KV group g: [q heads of g, k_g, v_g]; TP splits whole groups.
- ``linear_fc1`` is cat(gate, up); TP rank r holds cat(gate_r, up_r).
- ``linear_proj`` / ``linear_fc2`` split the input dim; embeddings / output layer split the
  (padded) vocab; norms are replicated.

Loading reads, on each rank, only the slices of the tensors its TP/PP shard needs
(safetensors' lazy slices). Export goes through `megagrpo.reshard`, the same generator that
feeds vLLM.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from megagrpo.config.model import (
    MEGATRON_LLAMA3_ROPE,
    MOE_ARCHITECTURES,
    ROPE_TYPES,
    ModelConfig,
    ParallelConfig,
)
from megagrpo.model import unwrap

HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                    "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
                    "Qwen2MoeForCausalLM": "qwen2_moe"}
MODEL_TYPES = {arch: cls for cls, arch in HF_ARCHITECTURES.items()}
"""megagrpo architecture -> HF class; the architecture is also the HF model_type."""
# config.json keys of features megagrpo does not implement, with what they mean; a truthy value
# is refused (the families above leave them unset, false or 0)
_REFUSED_KEYS = {
    "mlp_bias": "MLP biases", "attention_bias": "attention biases",
    "use_sliding_window": "sliding-window attention",
    "kv_lora_rank": "multi-head latent attention (MLA)", "q_lora_rank": "MLA query compression",
    "num_nextn_predict_layers": "multi-token prediction (MTP) layers",
    "n_routed_experts": "DeepSeek-style routed experts", "n_group": "group-limited routing",
    "moe_latent_size": "latent MoE",
}
_DENSE_REFUSED_KEYS = {"num_experts": "mixture of experts",
                       "num_local_experts": "mixture of experts"}
"""Refused for the dense families only (a Llama or Qwen2/3 config that routes to experts)."""


# ---------------------------------------------------------------- configs
def _read_config_json(path: Path) -> dict:
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: an HF checkpoint directory needs config.json")
    try:
        cfg = json.loads(path.read_text())
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        raise ValueError(f"{path} is not valid JSON ({e}): an HF checkpoint's config.json as "
                         "transformers writes it (save_pretrained) is needed") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} holds a {type(cfg).__name__}, not a JSON object of settings")
    return cfg


def _architecture(cfg: dict, path: Path) -> str:
    archs = cfg.get("architectures") or []
    arch = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"{path}: architectures={archs} is not supported; supported: "
            f"{sorted(HF_ARCHITECTURES)}"
        )
    model_type = cfg.get("model_type", arch)
    if model_type != arch:
        raise ValueError(f"{path}: model_type={model_type!r} with architectures={archs} is not "
                         f"supported; supported model_type values: {sorted(MODEL_TYPES)} (each "
                         "with its own architecture class)")
    return arch


def _refuse_unsupported(cfg: dict, path: Path, arch: str) -> None:
    """Features megagrpo lacks, named by their config.json key, before anything is built."""
    refused = dict(_REFUSED_KEYS)
    if arch not in MOE_ARCHITECTURES:
        refused.update(_DENSE_REFUSED_KEYS)
    for key, what in refused.items():
        if cfg.get(key):
            raise ValueError(f"{path}: {key}={json.dumps(cfg[key])} is not supported ({what}); "
                             "megagrpo trains Llama/Qwen2/Qwen3 and Qwen2-MoE/Qwen3-MoE models "
                             "without it")
    # Llama-like configs carry `sliding_window` only when it applies; Qwen2/3 carry a window
    # size that only use_sliding_window (checked above) switches on
    if cfg.get("sliding_window") and "use_sliding_window" not in cfg:
        raise ValueError(f"{path}: sliding_window={cfg['sliding_window']} is not supported "
                         "(sliding-window attention); full attention only")
    layers = [t for t in cfg.get("layer_types") or [] if t != "full_attention"]
    if layers:
        raise ValueError(f"{path}: layer_types holds {sorted(set(layers))} layers; only "
                         "'full_attention' is supported (no sliding-window or linear attention)")
    sinks = [k for k in cfg if "sink" in k.lower() and cfg[k]]
    if sinks:
        raise ValueError(f"{path}: {sinks[0]}={json.dumps(cfg[sinks[0]])} is not supported "
                         "(attention sinks)")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{path}: hidden_act={act!r} is not supported; SwiGLU (silu) only")


def _rope_from_hf(cfg: dict, path: Path) -> dict:
    """ModelConfig's rope_* fields from `rope_parameters` (transformers >= 5) or `rope_scaling`
    with a top-level `rope_theta` (older configs). Unimplemented types and parameters are
    refused naming the key."""
    key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    rope = cfg.get(key) or {}
    if not isinstance(rope, dict):
        raise ValueError(f"{path}: {key}={json.dumps(rope)} is not a mapping of RoPE settings")
    if rope and set(rope) <= {"full_attention", "sliding_attention"}:
        raise ValueError(f"{path}: {key} per layer type is not supported (one RoPE for all "
                         "layers only)")
    kind = rope.get("rope_type", rope.get("type")) or "default"
    if kind not in ROPE_TYPES:
        raise ValueError(f"{path}: {key}.rope_type={kind!r} is not supported; implemented: "
                         f"{list(ROPE_TYPES)} (linear, dynamic, yarn, longrope, ... are not)")
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"{path}: partial_rotary_factor={partial} is not supported (RoPE over "
                         "the whole head only)")
    out = {"rope_type": kind, "rope_theta": float(rope.get("rope_theta",
                                                           cfg.get("rope_theta", 10000.0)))}
    if kind == "llama3":
        out["rope_factor"] = float(rope.get("factor", 8.0))
        for name, want in MEGATRON_LLAMA3_ROPE.items():
            got = rope.get(name, want)
            if got != want:
                raise ValueError(
                    f"{path}: {key}.{name}={got} is not supported: megatron-core's llama3 RoPE "
                    f"scaling hard-codes {name}={want:g} (Llama-3.1/3.2/3.3's value)")
            out[f"rope_{name}"] = type(want)(got)
    return out


def model_config_from_hf(hf_dir: str | os.PathLike, *, dtype: str = "float32") -> ModelConfig:
    """Reads `config.json` of a Llama/Qwen2/Qwen3 checkpoint; refuses, naming the key, every
    feature megagrpo lacks (MoE, sliding windows, MLA, MTP, attention sinks, RoPE types other
    than default and llama3)."""
    path = Path(hf_dir) / "config.json"
    cfg = _read_config_json(path)
    arch = _architecture(cfg, path)
    _refuse_unsupported(cfg, path, arch)
    heads = cfg["num_attention_heads"]
    mc = ModelConfig(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        ffn_hidden_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_query_groups=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        qkv_bias=arch == "qwen2" or (arch == "qwen2_moe" and cfg.get("qkv_bias", True)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        dtype=dtype,
        **_rope_from_hf(cfg, path),
        **_moe_from_hf(cfg, arch),
    )
    mc.validate()
    return mc


def _moe_from_hf(cfg: dict, arch: str) -> dict:
    """ModelConfig's MoE fields from a Qwen3-MoE / Qwen2-MoE config.json (transformers 5 writes
    Qwen3-MoE's expert count as num_local_experts, the released checkpoints as num_experts)."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    out = dict(
        num_experts=cfg.get("num_experts") or cfg.get("num_local_experts") or 0,
        moe_topk=cfg.get("num_experts_per_tok", 2),
        moe_ffn_hidden_size=cfg.get("moe_intermediate_size", 0),
        moe_norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        moe_sparse_step=cfg.get("decoder_sparse_step", 1),
        moe_dense_layers=list(cfg.get("mlp_only_layers") or []),
        moe_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001)),
    )
    if arch == "qwen2_moe":
        out["shared_expert_ffn_hidden_size"] = cfg.get("shared_expert_intermediate_size", 0)
    return out


def _rope_parameters(model: ModelConfig) -> dict:
    rope: dict = {"rope_theta": model.rope_theta, "rope_type": model.rope_type}
    if model.rope_type == "llama3":
        rope.update(factor=model.rope_factor, low_freq_factor=model.rope_low_freq_factor,
                    high_freq_factor=model.rope_high_freq_factor,
                    original_max_position_embeddings=model.rope_original_max_position_embeddings)
    return rope


def hf_config_dict(model: ModelConfig) -> dict:
    """config.json contents that transformers (and vLLM) load for this model."""
    rope = _rope_parameters(model)
    d = {
        "architectures": [MODEL_TYPES[model.architecture]],
        "model_type": model.architecture,
        "vocab_size": model.vocab_size,
        "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_query_groups,
        "head_dim": model.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": model.rms_norm_eps,
        "rope_theta": model.rope_theta,
        "rope_parameters": rope,
        "tie_word_embeddings": model.tie_word_embeddings,
        "max_position_embeddings": model.max_position_embeddings,
        "torch_dtype": model.dtype,
        "bos_token_id": None,
        "eos_token_id": None,
    }
    if model.architecture == "llama":
        d.update(attention_bias=False, mlp_bias=False)
    else:
        d.update(use_sliding_window=False, sliding_window=None)
    if model.architecture in ("qwen3", "qwen3_moe"):
        d.update(attention_bias=False, layer_types=["full_attention"] * model.num_layers)
    if model.is_moe:
        d.update(num_experts=model.num_experts, num_experts_per_tok=model.moe_topk,
                 moe_intermediate_size=model.moe_ffn_hidden_size,
                 norm_topk_prob=model.moe_norm_topk_prob,
                 decoder_sparse_step=model.moe_sparse_step,
                 mlp_only_layers=list(model.moe_dense_layers),
                 router_aux_loss_coef=model.moe_aux_loss_coef, output_router_logits=False)
    if model.architecture == "qwen2_moe":
        d.update(shared_expert_intermediate_size=model.shared_expert_ffn_hidden_size,
                 qkv_bias=model.qkv_bias, layer_types=["full_attention"] * model.num_layers)
    return d


# ---------------------------------------------------------------- parameter map
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

    def local_shape(self, tp: int) -> tuple[int, ...]:
        s = list(self.full_shape)
        if self.split_dim is not None:
            s[self.split_dim] //= tp
        return tuple(s)


def param_specs(model: ModelConfig, parallel: ParallelConfig, pp_rank: int,
                impl: str = "local", ep_rank: int | None = None) -> list[ParamSpec]:
    """The parameters stage `pp_rank` holds, in a fixed order every rank agrees on.
    `impl` is the layer spec ('local' or 'transformer_engine': norms fused into linears).
    Routed experts: those of expert-parallel rank `ep_rank` only, or, with None, every EP
    rank's (each spec's `ep_owner` says whose)."""
    H, F, hd = model.hidden_size, model.ffn_hidden_size, model.head_dim
    nh, ng = model.num_attention_heads, model.num_query_groups
    Vp = parallel.padded_vocab_size(model.vocab_size)
    te = impl == "transformer_engine"
    first, last = pp_rank == 0, pp_rank == parallel.pp - 1
    per_stage = model.num_layers // parallel.pp
    out: list[ParamSpec] = []
    if first:
        out.append(ParamSpec("embedding.word_embeddings.weight", "vocab",
                             ("model.embed_tokens.weight",), (Vp, H)))
    qkv_rows = ng * (nh // ng + 2) * hd
    for i in range(per_stage):
        g = pp_rank * per_stage + i
        L, hf = f"decoder.layers.{i}.", f"model.layers.{g}."
        attn = hf + "self_attn."
        out.append(ParamSpec(L + ("self_attention.linear_qkv.layer_norm_weight" if te
                                  else "input_layernorm.weight"),
                             "replicated", (hf + "input_layernorm.weight",), (H,)))
        out.append(ParamSpec(L + "self_attention.linear_qkv.weight", "qkv",
                             (attn + "q_proj.weight", attn + "k_proj.weight",
                              attn + "v_proj.weight"), (qkv_rows, H)))
        if model.qkv_bias:
            out.append(ParamSpec(L + "self_attention.linear_qkv.bias", "qkv",
                                 (attn + "q_proj.bias", attn + "k_proj.bias",
                                  attn + "v_proj.bias"), (qkv_rows,)))
        if model.qk_norm:  # per-head RMSNorm weights: [head_dim], the same on every TP rank
            out.append(ParamSpec(L + "self_attention.q_layernorm.weight", "replicated",
                                 (attn + "q_norm.weight",), (hd,)))
            out.append(ParamSpec(L + "self_attention.k_layernorm.weight", "replicated",
                                 (attn + "k_norm.weight",), (hd,)))
        out.append(ParamSpec(L + "self_attention.linear_proj.weight", "row",
                             (attn + "o_proj.weight",), (H, nh * hd)))
        if model.is_moe_layer(g):
            out += _moe_specs(model, parallel, L, hf, ep_rank)
            continue
        out.append(ParamSpec(L + ("mlp.linear_fc1.layer_norm_weight" if te
                                  else "pre_mlp_layernorm.weight"),
                             "replicated", (hf + "post_attention_layernorm.weight",), (H,)))
        out += _mlp_specs(L + "mlp.", hf + "mlp.", H, F)
    if last:
        out.append(ParamSpec("decoder.final_layernorm.weight", "replicated",
                             ("model.norm.weight",), (H,)))
        if not model.tie_word_embeddings:
            out.append(ParamSpec("output_layer.weight", "vocab", ("lm_head.weight",), (Vp, H)))
        elif parallel.pp > 1:
            # the last stage's copy of the tied embedding; exported once, from stage 0
            out.append(ParamSpec("output_layer.weight", "vocab",
                                 ("model.embed_tokens.weight",), (Vp, H)))
    return out


def _mlp_specs(local: str, hf: str, H: int, F: int, ep_owner: int | None = None
               ) -> list[ParamSpec]:
    """A SwiGLU MLP: megatron's fused gate/up fc1 and fc2 <-> HF gate/up/down_proj."""
    return [ParamSpec(local + "linear_fc1.weight", "gate_up",
                      (hf + "gate_proj.weight", hf + "up_proj.weight"), (2 * F, H), ep_owner),
            ParamSpec(local + "linear_fc2.weight", "row", (hf + "down_proj.weight",), (H, F),
                      ep_owner)]


def _moe_specs(model: ModelConfig, parallel: ParallelConfig, L: str, hf: str,
               ep_rank: int | None) -> list[ParamSpec]:
    """An MoE layer's MLP part: the norm before it (never fused into a linear: the router reads
    it too), the router <-> HF `mlp.gate`, routed expert x = local expert x % (E/ep) of EP rank
    x // (E/ep), and Qwen2-MoE's shared expert with its sigmoid gate [1, H]."""
    H, E = model.hidden_size, model.num_experts
    per_rank = E // parallel.ep
    out = [ParamSpec(L + "pre_mlp_layernorm.weight", "replicated",
                     (hf + "post_attention_layernorm.weight",), (H,)),
           ParamSpec(L + "mlp.router.weight", "replicated", (hf + "mlp.gate.weight",), (E, H))]
    for x in range(E):
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


def hf_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Expected shape of every tensor in an HF checkpoint of this model."""
    H, F, hd = model.hidden_size, model.ffn_hidden_size, model.head_dim
    nh, ng, V = model.num_attention_heads, model.num_query_groups, model.vocab_size
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not model.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    for g in range(model.num_layers):
        p = f"model.layers.{g}."
        shapes.update({
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (nh * hd, H),
            p + "self_attn.k_proj.weight": (ng * hd, H),
            p + "self_attn.v_proj.weight": (ng * hd, H),
            p + "self_attn.o_proj.weight": (H, nh * hd),
        })
        if model.is_moe_layer(g):
            shapes[p + "mlp.gate.weight"] = (model.num_experts, H)
            mlps = [(f"{p}mlp.experts.{x}.", model.moe_ffn_hidden_size)
                    for x in range(model.num_experts)]
            if model.shared_expert_ffn_hidden_size:
                mlps.append((p + "mlp.shared_expert.", model.shared_expert_ffn_hidden_size))
                shapes[p + "mlp.shared_expert_gate.weight"] = (1, H)
        else:
            mlps = [(p + "mlp.", F)]
        for q, f in mlps:
            shapes.update({q + "gate_proj.weight": (f, H), q + "up_proj.weight": (f, H),
                           q + "down_proj.weight": (H, f)})
        if model.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (hd,),
                           p + "self_attn.k_norm.weight": (hd,)})
        if model.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (nh * hd,),
                           p + "self_attn.k_proj.bias": (ng * hd,),
                           p + "self_attn.v_proj.bias": (ng * hd,)})
    return shapes


# ---------------------------------------------------------------- layout conversions
def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """HF q [nh*hd, ...], k/v [ng*hd, ...] -> megatron [ng*(nh/ng+2)*hd, ...] (per group)."""
    rest = q.shape[1:]
    parts = [t.reshape(groups, -1, *rest) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def unfuse_shards(shards: list[torch.Tensor], spec: ParamSpec, model: ModelConfig
                  ) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors of `spec` from its TP shards (rank order): QKV split per group, gate/up
    split, vocab padding stripped. Each HF tensor is built with one copy straight from the
    shards (at TP=1 views where possible), so no full fused tensor is ever materialised."""
    if spec.kind == "replicated":
        return [(spec.hf[0], shards[0])]
    if spec.kind == "row":
        return [(spec.hf[0], _cat(shards, 1))]
    if spec.kind == "vocab":
        rows, parts = shards[0].shape[0], []
        for r, sh in enumerate(shards):
            if r * rows < model.vocab_size:
                parts.append(sh[: model.vocab_size - r * rows])
        return [(spec.hf[0], _cat(parts, 0))]
    if spec.kind == "gate_up":  # rank r holds cat(gate_r, up_r)
        half = shards[0].shape[0] // 2
        return [(spec.hf[0], _cat([s[:half] for s in shards], 0)),
                (spec.hf[1], _cat([s[half:] for s in shards], 0))]
    hd = model.head_dim
    qper = model.num_attention_heads // model.num_query_groups * hd
    rest = shards[0].shape[1:]
    grouped = [s.view(-1, qper + 2 * hd, *rest) for s in shards]  # [groups_r, q+k+v, ...]
    out = []
    for name, lo, hi in zip(spec.hf, (0, qper, qper + hd), (qper, qper + hd, qper + 2 * hd)):
        part = torch.cat([g[:, lo:hi] for g in grouped]) if len(grouped) > 1 \
            else grouped[0][:, lo:hi].contiguous()
        out.append((name, part.view(-1, *rest)))
    return out


def _cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


class HFCheckpoint:
    """Lazy reader of a local HF safetensors checkpoint (single file or sharded with index)."""

    def __init__(self, hf_dir: str | os.PathLike):
        from safetensors import safe_open

        self.dir = Path(hf_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            self.files = json.loads(index.read_text())["weight_map"]
        elif (self.dir / "model.safetensors").exists():
            with safe_open(self.dir / "model.safetensors", "pt") as f:
                self.files = {k: "model.safetensors" for k in f.keys()}
        else:
            raise FileNotFoundError(
                f"{self.dir}: no model.safetensors or model.safetensors.index.json")
        self._open = safe_open
        self._handles: dict[str, object] = {}

    def _handle(self, name: str, needed_by: str):
        if name not in self.files:
            raise ValueError(
                f"checkpoint {self.dir} lacks tensor {name!r} (needed for {needed_by})")
        fname = self.files[name]
        if fname not in self._handles:
            self._handles[fname] = self._open(self.dir / fname, "pt")
        return self._handles[fname]

    def shape(self, name: str, needed_by: str) -> tuple[int, ...]:
        return tuple(self._handle(name, needed_by).get_slice(name).get_shape())

    def rows(self, name: str, start: int, stop: int, needed_by: str) -> torch.Tensor:
        """Rows [start, stop) of dim 0, read without loading the rest."""
        return self._handle(name, needed_by).get_slice(name)[start:stop]

    def cols(self, name: str, start: int, stop: int, needed_by: str) -> torch.Tensor:
        return self._handle(name, needed_by).get_slice(name)[:, start:stop]


def check_hf_checkpoint(hf_dir: str | os.PathLike, model: ModelConfig) -> None:
    """Every tensor the model needs is present with the right shape (reads headers only)."""
    ckpt = HFCheckpoint(hf_dir)
    expected = hf_shapes(model)
    missing = sorted(n for n in expected if n not in ckpt.files)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint {ckpt.dir} lacks tensors {missing[:5]}{more}")
    for name, shape in expected.items():
        got = ckpt.shape(name, name)
        if got != shape:
            raise ValueError(f"checkpoint {ckpt.dir}: tensor {name!r} has shape {list(got)}, "
                             f"expected {list(shape)} for this config")


def read_shard(ckpt: HFCheckpoint, spec: ParamSpec, model: ModelConfig, tp_rank: int, tp: int,
               expected: dict[str, tuple[int, ...]]) -> torch.Tensor:
    """The TP shard `tp_rank` of `spec`, built from only the HF rows/columns it needs."""
    for name in spec.hf:
        got = ckpt.shape(name, spec.local)
        if got != expected[name]:
            raise ValueError(f"checkpoint {ckpt.dir}: tensor {name!r} has shape {list(got)}, "
                             f"expected {list(expected[name])} for this config")
    if spec.kind == "replicated":
        return ckpt.rows(spec.hf[0], 0, spec.full_shape[0], spec.local)
    if spec.kind == "row":
        n = spec.full_shape[1] // tp
        return ckpt.cols(spec.hf[0], tp_rank * n, (tp_rank + 1) * n, spec.local)
    if spec.kind == "gate_up":
        n = spec.full_shape[0] // 2 // tp
        return torch.cat([ckpt.rows(h, tp_rank * n, (tp_rank + 1) * n, spec.local)
                          for h in spec.hf])
    if spec.kind == "qkv":
        ng, hd = model.num_query_groups // tp, model.head_dim
        qn = model.num_attention_heads // model.num_query_groups * hd * ng
        q = ckpt.rows(spec.hf[0], tp_rank * qn, (tp_rank + 1) * qn, spec.local)
        k = ckpt.rows(spec.hf[1], tp_rank * ng * hd, (tp_rank + 1) * ng * hd, spec.local)
        v = ckpt.rows(spec.hf[2], tp_rank * ng * hd, (tp_rank + 1) * ng * hd, spec.local)
        return fuse_qkv(q, k, v, ng)
    # vocab: rows of this rank's padded slice that exist in HF, zero padding after
    n = spec.full_shape[0] // tp
    lo, hi = tp_rank * n, min((tp_rank + 1) * n, model.vocab_size)
    shard = torch.zeros(n, *spec.full_shape[1:], dtype=_dtype_of(ckpt, spec))
    if hi > lo:
        shard[: hi - lo] = ckpt.rows(spec.hf[0], lo, hi, spec.local)
    return shard


def _dtype_of(ckpt: HFCheckpoint, spec: ParamSpec) -> torch.dtype:
    return ckpt.rows(spec.hf[0], 0, 1, spec.local).dtype


def load_hf_weights(gpt: torch.nn.Module, hf_dir: str | os.PathLike, model: ModelConfig,
                    parallel: ParallelConfig, *, tp_rank: int, pp_rank: int,
                    ep_rank: int | None = None) -> int:
    """Copies this rank's shards of an HF checkpoint into `gpt` (a GPTModel stage) in place
    (routed experts: those of expert-parallel rank `ep_rank`, default megatron's).
    Every tensor is checked (present, right shape) before any parameter is written.
    Returns the number of bytes read."""
    gpt = unwrap(gpt)
    params = dict(gpt.named_parameters())
    impl = "transformer_engine" if any("layer_norm_weight" in n for n in params) else "local"
    if ep_rank is None:
        ep_rank = expert_parallel_rank(parallel)
    specs = param_specs(model, parallel, pp_rank, impl, ep_rank)
    expected = hf_shapes(model)
    missing = sorted(set(params) - {s.local for s in specs})
    if missing:
        raise RuntimeError(f"megatron parameters without an HF source: {missing}")
    ckpt = HFCheckpoint(hf_dir)
    shards = {s.local: read_shard(ckpt, s, model, tp_rank, parallel.tp, expected) for s in specs}
    nbytes = 0
    with torch.no_grad():
        for s in specs:
            p, t = params[s.local], shards[s.local]
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"{s.local}: shard shape {list(t.shape)} != parameter "
                                 f"{list(p.shape)}")
            p.copy_(t)
            nbytes += t.numel() * t.element_size()
    return nbytes


def expert_parallel_rank(parallel: ParallelConfig) -> int:
    """This rank's expert-parallel rank (megatron's parallel_state; 0 without EP)."""
    if parallel.ep == 1:
        return 0
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_rank()


def save_hf_dir(out_dir: str | os.PathLike, model: ModelConfig,
                pairs: Iterable[tuple[str, torch.Tensor]], *, write: bool = True,
                shard_bytes: int = 2 << 30) -> None:
    """Writes an HF checkpoint from a stream of (name, tensor) pairs: safetensors shards of at
    most `shard_bytes` (one tensor if larger) plus the index and config.json, renamed into place
    at the end. `write=False` only drains the stream (ranks other than the writer must still
    take part in its collectives)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    files: list[list[str]] = []
    cur: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        out.mkdir(parents=True, exist_ok=True)
        save_file(cur, str(out / f"shard-{len(files):05d}.tmp"), metadata={"format": "pt"})
        files.append(list(cur))

    for name, tensor in pairs:
        if not write:
            continue
        n = tensor.numel() * tensor.element_size()
        if cur and size + n > shard_bytes:
            flush()
            cur, size = {}, 0
        cur[name] = tensor.contiguous()
        size += n
    if not write:
        return
    if cur:
        flush()
    total, weight_map, nbytes = len(files), {}, 0
    for i, names in enumerate(files):
        final = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
        os.replace(out / f"shard-{i:05d}.tmp", out / final)
        weight_map.update({n: final for n in names})
        nbytes += (out / final).stat().st_size
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": nbytes}, "weight_map": dict(sorted(weight_map.items()))},
        indent=1))
    (out / "config.json").write_text(json.dumps(hf_config_dict(model), indent=1))
