"""HF `config.json` <-> ModelConfig: reading (with every unsupported feature refused by its key),
writing, and RoPE settings. Families: Llama (default or llama3 RoPE), Qwen2 (QKV bias), Qwen3
(q/k norms), Qwen3-MoE and Qwen2-MoE (routed experts; Qwen2-MoE's gated shared expert).
No torch: the launcher's preflight and the planner read configs without it."""
from __future__ import annotations

import json
import os
from pathlib import Path

from megagrpo.config.model import (
    MEGATRON_LLAMA3_ROPE,
    MOE_ARCHITECTURES,
    ROPE_TYPES,
    ModelConfig,
)

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


def _architecture(cfg: dict, path: str | os.PathLike) -> str:
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


def _refuse_unsupported(cfg: dict, path: str | os.PathLike, arch: str) -> None:
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


def _rope_from_hf(cfg: dict, path: str | os.PathLike) -> dict:
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
    """Reads `config.json` of a Llama/Qwen2/Qwen3(-MoE)/Qwen2-MoE checkpoint; refuses, naming
    the key, every feature megagrpo lacks (sliding windows, MLA, MTP, attention sinks, RoPE
    types other than default and llama3, experts in a dense family)."""
    path = Path(hf_dir) / "config.json"
    return model_config_from_hf_dict(_read_config_json(path), path, dtype=dtype)


def model_config_from_hf_dict(cfg: dict, path: str | os.PathLike, *,
                              dtype: str = "float32") -> ModelConfig:
    """`model_config_from_hf` on config.json's contents (e.g. a transformers config's
    `to_dict()`); `path` names the source in the errors."""
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

