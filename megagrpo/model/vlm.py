"""Qwen2.5-VL on megatron-core: the decoder is megatron's `GPTModel` with multimodal RoPE
(position_embedding_type='mrope', `model.mrope_section`), fed input embeddings in which each
image-pad token's embedding is replaced by the vision tower's merged patch features.

Layout choices (docs/vlm.md):
- The vision tower and merger are transformers' own `Qwen2_5_VisionTransformerPretrainedModel`,
  built from the HF vision config and **replicated** on every TP rank (the simplest correct
  layout: it is ~0.7B of 7B in the released models, and with TP activations replicated each
  rank receives the full gradient of its features, so replicated weights get identical,
  complete gradients without any reduction). Its weights map by name (`visual.*` <->
  `vision.*`, `megagrpo.config.params.vision_specs`). Frozen by default
  (`model.freeze_vision`: no gradients, no optimizer state); trainable when asked.
- The class is a `GPTModel` subclass, so every parameter of the decoder keeps GPTModel's name
  and the loader, exporter, weight sync and verify read the one parameter layout unchanged.
- Positions are [3, B, S] (temporal, height, width): `rope_index` computes them from the
  token ids and each image's patch grid as transformers' `get_rope_index` does.

Images come as transformers' processor gives them: `pixel_values` [sum_i t_i*h_i*w_i,
C*temporal_patch*patch*patch] (each patch flattened, images concatenated in prompt order) and
`image_grid_thw` [n_images, 3] (patches along time, height, width); image i fills
t_i*h_i*w_i / spatial_merge_size^2 image-pad tokens of the prompt.
"""
from __future__ import annotations

import functools

import torch

from megagrpo.config.model import ModelConfig, VisionConfig
from megagrpo.parallel.mrope import image_tokens, rope_index, rope_positions

__all__ = ["image_tokens", "rope_index", "rope_positions", "build_vision_tower",
           "hf_vision_config", "vlm_class"]


# ---------------------------------------------------------------- the vision tower
def hf_vision_config(vision: VisionConfig):
    """transformers' `Qwen2_5_VLVisionConfig` of `vision` (SDPA attention, as transformers'
    default)."""
    from transformers import Qwen2_5_VLConfig

    cfg = Qwen2_5_VLConfig(vision_config=dict(
        depth=vision.depth, hidden_size=vision.hidden_size, hidden_act="silu",
        intermediate_size=vision.intermediate_size, num_heads=vision.num_heads,
        in_channels=vision.in_channels, patch_size=vision.patch_size,
        temporal_patch_size=vision.temporal_patch_size,
        spatial_merge_size=vision.spatial_merge_size, window_size=vision.window_size,
        out_hidden_size=vision.out_hidden_size,
        fullatt_block_indexes=list(vision.fullatt_block_indexes),
        tokens_per_second=vision.tokens_per_second,
        rope_parameters={"rope_theta": vision.rope_theta, "rope_type": "axial"}))
    v = cfg.vision_config
    v._attn_implementation = "sdpa"
    return v


def build_vision_tower(model: ModelConfig, dtype: torch.dtype) -> torch.nn.Module:
    """The vision tower + merger, randomly initialised from torch's global stream (seeded by
    the caller: every rank draws the same weights); load real ones by name."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(
        hf_vision_config(model.vision), dtype=dtype)
    tower.requires_grad_(not model.freeze_vision)
    return tower


# ---------------------------------------------------------------- the model
@functools.lru_cache(maxsize=1)
def vlm_class() -> type:
    """megatron's GPTModel with the vision tower beside its embedding (built lazily: megatron
    imports take seconds and the launcher never needs them)."""
    from megatron.core.models.gpt import GPTModel

    class Qwen25VLModel(GPTModel):
        """GPTModel (position_embedding_type='mrope') + `vision` on the first stage.

        forward(input_ids [B, S], position_ids [3, B, S], attention_mask, ...,
        pixel_values [P, C*t*p*p] | None, image_grid_thw [n, 3] | None): logits as GPTModel's.
        """

        def __init__(self, *args, vlm: ModelConfig, **kwargs):
            super().__init__(*args, **kwargs)
            self.image_token_id = vlm.image_token_id
            if self.pre_process:
                self.vision = build_vision_tower(vlm, self.config.params_dtype)

        def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, *args,
                    pixel_values: torch.Tensor | None = None,
                    image_grid_thw: torch.Tensor | None = None,
                    image_mask: torch.Tensor | None = None, **kwargs):
            if position_ids is None or position_ids.dim() != 3 or position_ids.shape[0] != 3:
                got = None if position_ids is None else list(position_ids.shape)
                raise ValueError(f"position_ids {got}: Qwen2.5-VL needs [3, B, S] multimodal "
                                 "positions (megagrpo.model.vlm.rope_positions)")
            if decoder_input is None and self.pre_process:
                decoder_input = self.embed(input_ids, pixel_values, image_grid_thw, image_mask)
            return super().forward(input_ids, position_ids, attention_mask, decoder_input,
                                   *args, **kwargs)

        def embed(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None,
                  image_grid_thw: torch.Tensor | None,
                  image_mask: torch.Tensor | None = None) -> torch.Tensor:
            """[S, B, H] decoder input: the word embeddings, image pads replaced by the
            merged vision features (in row-major order of the pads, images in order).
            `image_mask` [B, S]: which pads are images (the prompt's; a pad sampled in a
            completion is text); None: every pad."""
            emb = self.embedding(input_ids=input_ids, position_ids=None)  # [S, B, H]
            mask = input_ids == self.image_token_id if image_mask is None else image_mask
            n = int(mask.sum())
            if pixel_values is None:
                if n:
                    raise ValueError(f"{n} image-pad tokens but no pixel_values")
                return emb
            feats = self.vision(pixel_values, grid_thw=image_grid_thw).pooler_output
            if feats.shape[0] != n:
                raise ValueError(f"image_grid_thw gives {feats.shape[0]} merged patches but "
                                 f"input_ids hold {n} image-pad tokens")
            feats = feats.to(emb.dtype)
            bsh = emb.transpose(0, 1).masked_scatter(mask[..., None], feats)
            return bsh.transpose(0, 1).contiguous()

    return Qwen25VLModel
