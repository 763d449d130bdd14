"""Tiny random HF checkpoints (Llama, Llama-3.1, Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE,
Qwen2.5-VL) built from transformers' config classes (no downloads), and `load_dir` to read one
back. Each builder saves to `path` and returns the model (fp32, eval mode)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

# what every dense builder shares: width 64, GQA 4/2 with head_dim 32 (vLLM's CPU attention
# needs 32 or 64)
_SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6)


def tiny_llama(path, *, vocab=100, layers=2, tie=False, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, num_hidden_layers=layers, rope_theta=10000.0,
                      tie_word_embeddings=tie, max_position_embeddings=256, **_SMALL)
    return _finish(LlamaForCausalLM(cfg), path)


def tiny_qwen2(path, *, vocab=100, layers=2, tie=True, seed=1):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, num_hidden_layers=layers, rope_theta=1e6,
                      tie_word_embeddings=tie, max_position_embeddings=256,
                      use_sliding_window=False, **_SMALL)
    return _finish(Qwen2ForCausalLM(cfg), path, biases=True)


def tiny_qwen3(path, *, vocab=100, layers=2, tie=False, seed=2):
    """Qwen3 with head_dim 32 != hidden / heads (64 / 4 = 16), as in the real family."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, num_hidden_layers=layers, rope_theta=1e6,
                      tie_word_embeddings=tie, max_position_embeddings=512,
                      use_sliding_window=False, **_SMALL)
    return _finish(Qwen3ForCausalLM(cfg), path)


def tiny_qwen3_moe(path, *, vocab=100, layers=2, seed=4, dense_layers=()):
    """Qwen3-MoE: 4 experts, top-2 renormalised, expert width 64 (vLLM's CPU experts need a
    multiple of 32 per vLLM TP rank); a router initialised wide
    enough that routing is decisive (HF's 0.02 init makes every token's top-2 a near tie)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=vocab, moe_intermediate_size=64, num_experts=4,
                         num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                         mlp_only_layers=list(dense_layers), num_hidden_layers=layers,
                         rope_theta=1e6, tie_word_embeddings=False, max_position_embeddings=512,
                         use_sliding_window=False, **_SMALL)
    return _finish(Qwen3MoeForCausalLM(cfg), path, routers=True)


def tiny_qwen2_moe(path, *, vocab=100, layers=2, seed=5, dense_layers=(1,)):
    """Qwen2-MoE: 4 experts of width 64, top-2 without renormalisation, a gated shared expert
    (width 48),
    QKV biases, layer 1 dense (mlp_only_layers). Width 128 for head_dim 32 (Qwen2-MoE derives
    head_dim from hidden / heads; vLLM's CPU attention needs 32 or 64)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2MoeConfig(vocab_size=vocab, hidden_size=128, intermediate_size=128,
                         moe_intermediate_size=64, shared_expert_intermediate_size=48,
                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                         decoder_sparse_step=1, mlp_only_layers=list(dense_layers),
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         max_position_embeddings=512, use_sliding_window=False)
    return _finish(Qwen2MoeForCausalLM(cfg), path, routers=True, biases=True)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
               "rope_theta": 500000.0}


def tiny_llama31(path, *, vocab=100, layers=2, seed=3, rope=LLAMA3_ROPE):
    """Llama-3.1-style: llama3 RoPE scaling (megatron-core's fixed low/high factors and 8192
    original positions). Query/key weights are scaled up so that attention is sharp and the
    positions (hence the RoPE frequencies) visibly change the logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, num_hidden_layers=layers, tie_word_embeddings=False,
                      max_position_embeddings=16384, rope_parameters=dict(rope),
                      **dict(_SMALL, rms_norm_eps=1e-5))
    return _finish(LlamaForCausalLM(cfg), path, sharp_attention=True)


def tiny_qwen25_vl(path, *, vocab=256, layers=2, seed=6):
    """Qwen2.5-VL: the decoder at width 64, 2 heads / 2 KV heads of head_dim 32 (vLLM's CPU
    attention), mrope_section [4, 6, 6]; a 2-block vision tower of width 32 over 2x2-pixel
    patches (2 frames), merge size 2, window 8 pixels (= 2x2 merged tokens), block 1 full
    attention. Special tokens at the top of the vocab: vision start 250, end 251, image 252,
    video 253. 8x8-pixel image = 4x4 patches = 4 image tokens."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=None,
                         eos_token_id=None,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [4, 6, 6]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                           patch_size=2, temporal_patch_size=2, spatial_merge_size=2,
                           window_size=8, out_hidden_size=64, fullatt_block_indexes=[1]),
        vision_start_token_id=250, vision_end_token_id=251, image_token_id=252,
        video_token_id=253)
    return _finish(Qwen2_5_VLForConditionalGeneration(cfg), path, biases=True)


BUILDERS = {"llama": tiny_llama, "llama31": tiny_llama31, "qwen2": tiny_qwen2,
            "qwen3": tiny_qwen3, "qwen3_moe": tiny_qwen3_moe, "qwen2_moe": tiny_qwen2_moe,
            "qwen2_5_vl": tiny_qwen25_vl}
"""Builder of each family, by the folder name `tiny_dirs` gives it."""


def tiny_dirs(root: Path, *families: str) -> Path:
    """One checkpoint per family (default arguments) in `root/<family>`; returns `root`
    (the `hf_dirs` fixtures of the model-family tests)."""
    for name in families:
        BUILDERS[name](root / name)
    return root


def edited_copy(src: Path, dst: Path, **changes) -> Path:
    """A copy of the checkpoint folder `src` at `dst` with `changes` made to its config.json."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def perturbed(model, scale: float = 0.05, seed: int = 1):
    """A copy of the HF `model` (eval mode) with seeded normal noise of std `scale` added to
    every weight: a policy a few steps on, for checks that the engine follows new weights."""
    new = type(model)(model.config).eval()
    new.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return new


def _finish(model, path, *, biases: bool = False, routers: bool = False,
            sharp_attention: bool = False):
    """fp32 eval model with the parameters HF initialises flat made to matter (norms not all
    1, biases not 0, routers decisive, attention sharp), saved to `path`."""
    model = model.float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
        if routers:  # HF's 0.02 init makes every token's top-2 a near tie
            for n, p in model.named_parameters():
                if n.endswith("mlp.gate.weight") or n.endswith("shared_expert_gate.weight"):
                    p.normal_(0, 0.5)
        if biases:  # biases start at 0 in HF init
            for n, p in model.named_parameters():
                if n.endswith("bias"):
                    p.normal_(0, 0.1)
        if sharp_attention:
            for n, p in model.named_parameters():
                if n.endswith(("q_proj.weight", "k_proj.weight")):
                    p.mul_(8.0)
    model.save_pretrained(path)
    return model


def load_dir(path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF safetensors directory (single file or sharded)."""
    from safetensors.torch import load_file

    out = {}
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""A ChatML template (Qwen's layout) for the tiny tokenizer."""


def tiny_char_tokenizer(path):
    """A character-level HF tokenizer (printable ASCII + newline, ChatML specials, <pad> = 0)
    with the ChatML chat template, saved to `path`; returns it."""
    from tokenizers import Regex, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    raw = RawTokenizer(models.WordLevel({w: i for i, w in enumerate(specials + chars)},
                                        unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", unk_token="<unk>",
                                  eos_token="<|im_end|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHATML
    tok.save_pretrained(path)
    return tok


VL_SPECIALS = {250: "<|vision_start|>", 251: "<|vision_end|>", 252: "<|image_pad|>",
               253: "<|video_pad|>"}
"""tiny_qwen25_vl's vision tokens, as Qwen's tokenizer spells them."""


def tiny_vl_tokenizer(path, *, min_pixels: int = 16, max_pixels: int = 4096):
    """The character tokenizer (ids 0-99) plus Qwen's vision tokens at tiny_qwen25_vl's ids
    (`VL_SPECIALS`), and transformers' Qwen2-VL image processor at that model's patch sizes
    (2x2 pixels, 2 frames, merge 2; an 8x8 image = 4 image tokens) with small pixel limits,
    saved to `path`; returns (tokenizer, image processor)."""
    from tokenizers import Regex, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    specials = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {w: i for i, w in enumerate(specials + chars)}
    vocab.update({t: i for i, t in VL_SPECIALS.items()})
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", unk_token="<unk>",
                                  eos_token="<|im_end|>",
                                  additional_special_tokens=["<|im_start|>",
                                                             *VL_SPECIALS.values()])
    tok.chat_template = CHATML
    tok.save_pretrained(path)
    proc = Qwen2VLImageProcessorPil(patch_size=2, temporal_patch_size=2, merge_size=2,
                                    min_pixels=min_pixels, max_pixels=max_pixels)
    proc.save_pretrained(path)
    return tok, proc


def tiny_reward_model(path, *, arch: str = "qwen2", seed: int = 6):
    """A random *ForSequenceClassification reward model (one output, the layout of Qwen /
    Skywork reward checkpoints) with the character tokenizer, saved to `path`; returns it."""
    from transformers import (
        LlamaConfig,
        LlamaForSequenceClassification,
        Qwen2Config,
        Qwen2ForSequenceClassification,
    )

    torch.manual_seed(seed)
    vocab = len(tiny_char_tokenizer(path))
    common = dict(vocab_size=vocab, num_hidden_layers=2, max_position_embeddings=512,
                  num_labels=1, pad_token_id=0, **_SMALL)
    if arch == "qwen2":
        model = Qwen2ForSequenceClassification(Qwen2Config(use_sliding_window=False, **common))
    else:
        model = LlamaForSequenceClassification(LlamaConfig(**common))
    with torch.no_grad():  # a score head as large as the rest: rewards that differ visibly
        model.score.weight.normal_(0, 1.0)
    return _finish(model, path, biases=arch == "qwen2")
