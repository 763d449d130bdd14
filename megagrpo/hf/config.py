"""HF `config.json` <-> ModelConfig: reading (with every unsupported feature refused by its key),
writing, and RoPE settings. Families: Llama (default or llama3 RoPE), Qwen2 (QKV bias), Qwen3
(q/k norms), Qwen3-MoE and Qwen2-MoE (routed experts; Qwen2-MoE's gated shared expert),
Qwen2.5-VL (a Qwen2 decoder with multimodal RoPE, plus the vision tower and merger).
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
    VisionConfig,
)

HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                    "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
                    "Qwen2MoeForCausalLM": "qwen2_moe",
                    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl"}
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
    vlm: dict = {}
    if arch == "qwen2_5_vl":
        cfg, vlm = _text_config(cfg), _vlm_from_hf(cfg, path)
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
        qkv_bias=arch in ("qwen2", "qwen2_5_vl") or (arch == "qwen2_moe"
                                                    and cfg.get("qkv_bias", True)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        dtype=dtype,
        **_rope_from_hf(cfg, path),
        **_moe_from_hf(cfg, arch),
        **vlm,
    )
    mc.validate()
    return mc


def _text_config(cfg: dict) -> dict:
    """Qwen2.5-VL's decoder settings: transformers 5 nests them in `text_config`, the released
    checkpoints' config.json keeps them at the top level (both read; the nested ones win).
    An `mrope` RoPE type (older configs) is default RoPE frequencies with mrope_section."""
    text = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
    text.update(cfg.get("text_config") or {})
    text["architectures"], text["model_type"] = cfg.get("architectures"), "qwen2_5_vl"
    for key in ("rope_parameters", "rope_scaling"):
        rope = text.get(key)
        if isinstance(rope, dict):
            rope = {k: v for k, v in rope.items() if k != "mrope_section"}
            if rope.get("rope_type", rope.get("type")) == "mrope":
                rope["rope_type"] = "default"
                rope.pop("type", None)
            text[key] = rope
    return text


def _mrope_section(cfg: dict, path: str | os.PathLike) -> list[int]:
    text = {**cfg, **(cfg.get("text_config") or {})}
    for key in ("rope_parameters", "rope_scaling"):
        section = (text.get(key) or {}).get("mrope_section")
        if section:
            return [int(x) for x in section]
    raise ValueError(f"{path}: rope_parameters.mrope_section is missing: Qwen2.5-VL's "
                     "multimodal RoPE needs it (e.g. [16, 24, 24])")


def _vlm_from_hf(cfg: dict, path: str | os.PathLike) -> dict:
    """ModelConfig's vision-language fields from a Qwen2.5-VL config.json."""
    v = cfg.get("vision_config")
    if not isinstance(v, dict):
        raise ValueError(f"{path}: vision_config is missing: a Qwen2.5-VL config.json holds "
                         "the vision tower's settings there")
    act = v.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{path}: vision_config.hidden_act={act!r} is not supported; the "
                         "vision tower's SwiGLU (silu) only")
    for key in ("patch_size", "temporal_patch_size"):
        if isinstance(v.get(key), (list, tuple)):
            raise ValueError(f"{path}: vision_config.{key}={v[key]}: one integer is needed "
                             "(square patches)")
    theta = (v.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    vision = VisionConfig(
        depth=v.get("depth", 32), hidden_size=v.get("hidden_size", 3584),
        intermediate_size=v.get("intermediate_size", 3420),
        num_heads=v.get("num_heads", 16),
        in_channels=v.get("in_channels", v.get("in_chans", 3)),  # released configs: in_chans
        patch_size=v.get("patch_size", 14), temporal_patch_size=v.get("temporal_patch_size", 2),
        spatial_merge_size=v.get("spatial_merge_size", 2), window_size=v.get("window_size", 112),
        out_hidden_size=v.get("out_hidden_size", 3584),
        fullatt_block_indexes=list(v.get("fullatt_block_indexes", [7, 15, 23, 31])),
        tokens_per_second=v.get("tokens_per_second", 4), rope_theta=float(theta))
    return dict(vision=vision, mrope_section=_mrope_section(cfg, path),
                image_token_id=cfg.get("image_token_id", 151655),
                video_token_id=cfg.get("video_token_id", 151656),
                vision_start_token_id=cfg.get("vision_start_token_id", 151652),
                vision_end_token_id=cfg.get("vision_end_token_id", 151653))


def _vlm_config_dict(model: ModelConfig, text: dict) -> dict:
    """Qwen2.5-VL's config.json as transformers 5 writes it: the decoder in text_config."""
    v = model.vision
    text = {k: val for k, val in text.items() if k not in ("architectures", "model_type")}
    text.update(model_type="qwen2_5_vl_text", use_sliding_window=False, sliding_window=None,
                layer_types=["full_attention"] * model.num_layers)
    text["rope_parameters"] = {**text["rope_parameters"],
                               "mrope_section": list(model.mrope_section)}
    tie = text.pop("tie_word_embeddings")
    return {
        "architectures": [MODEL_TYPES[model.architecture]], "model_type": model.architecture,
        "text_config": text, "tie_word_embeddings": tie, "dtype": model.dtype,
        "image_token_id": model.image_token_id, "video_token_id": model.video_token_id,
        "vision_start_token_id": model.vision_start_token_id,
        "vision_end_token_id": model.vision_end_token_id,
        "vision_config": {
            "model_type": "qwen2_5_vl_vision", "depth": v.depth, "hidden_size": v.hidden_size,
            "hidden_act": "silu", "intermediate_size": v.intermediate_size,
            "num_heads": v.num_heads, "in_channels": v.in_channels, "patch_size": v.patch_size,
            "temporal_patch_size": v.temporal_patch_size,
            "spatial_merge_size": v.spatial_merge_size, "window_size": v.window_size,
            "out_hidden_size": v.out_hidden_size,
            "fullatt_block_indexes": list(v.fullatt_block_indexes),
            "tokens_per_second": v.tokens_per_second,
            "rope_parameters": {"rope_theta": v.rope_theta, "rope_type": "axial"}},
    }


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
    if model.is_vlm:
        return _vlm_config_dict(model, d)
    return d

