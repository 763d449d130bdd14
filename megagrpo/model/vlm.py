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


# ---------------------------------------------------------------- 3-D positions
def image_tokens(grid_thw: torch.Tensor, vision: VisionConfig) -> torch.Tensor:
    """[n] image-pad tokens each image fills: t * h * w / spatial_merge_size^2."""
    return grid_thw.prod(-1) // vision.spatial_merge_size ** 2


def rope_index(ids: torch.Tensor, grid_thw: torch.Tensor | None, model: ModelConfig
               ) -> tuple[torch.Tensor, int]:
    """Multimodal RoPE positions of one sequence: ([3, S] long, delta).

    Text tokens advance all three positions together by one. An image at text position p with
    a merged grid (t, h', w') = (t, h/m, w/m) takes positions (p + ti, p + hi, p + wi) over its
    tokens in (t, h, w) row-major order, and the text after it continues at p + max(h', w').
    `delta` = max position + 1 - S (what decoding adds to 1-D positions after the prompt).
    `ids` [S]; `grid_thw` [n, 3] of the images in the order their pads appear (None: none).
    A run of image pads may hold several images back to back: each takes its own token count.
    """
    merge = model.vision.spatial_merge_size
    is_image = ids == model.image_token_id
    grids = [] if grid_thw is None else [tuple(int(x) for x in g) for g in grid_thw]
    want = sum(t * h * w // merge ** 2 for t, h, w in grids)
    if int(is_image.sum()) != want:
        raise ValueError(f"the sequence holds {int(is_image.sum())} image-pad tokens "
                         f"(model.image_token_id={model.image_token_id}) but image_grid_thw "
                         f"{grids} needs {want}: one pad per merged patch of every image")
    parts, pos, i, S, image = [], 0, 0, len(ids), 0
    flags = is_image.tolist()
    while i < S:
        if not flags[i]:
            j = i
            while j < S and not flags[j]:
                j += 1
            parts.append(torch.arange(pos, pos + j - i).expand(3, -1))
            pos, i = pos + j - i, j
            continue
        t, h, w = grids[image]
        h, w = h // merge, w // merge
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w),
                                          indexing="ij")).reshape(3, -1)
        parts.append(grid + pos)
        pos, i, image = pos + max(h, w), i + t * h * w, image + 1
    out = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)
    return out, int(out.max()) + 1 - S if S else 0


def rope_positions(input_ids: torch.Tensor, grid_thw: torch.Tensor | None, model: ModelConfig
                   ) -> torch.Tensor:
    """[3, B, S] positions of a right-padded batch [B, S]: `rope_index` per row, the rows'
    images taken from `grid_thw` [n, 3] in row-major order (padding after a row's text is
    text: it attends to nothing that matters and is never a loss position)."""
    counts = (input_ids == model.image_token_id).sum(1).tolist()
    tokens = [] if grid_thw is None else image_tokens(grid_thw, model.vision).tolist()
    rows, k = [], 0
    for b, n in enumerate(counts):
        j, got = k, 0
        while got < n and j < len(tokens):
            got, j = got + tokens[j], j + 1
        rows.append(rope_index(input_ids[b], grid_thw[k:j] if j > k else None, model)[0])
        k = j
    if k != len(tokens):
        raise ValueError(f"image_grid_thw holds {len(tokens)} images but the batch's image-pad "
                         f"tokens account for {k}")
    return torch.stack(rows, dim=1)


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
                    image_grid_thw: torch.Tensor | None = None, **kwargs):
            if position_ids is None or position_ids.dim() != 3 or position_ids.shape[0] != 3:
                got = None if position_ids is None else list(position_ids.shape)
                raise ValueError(f"position_ids {got}: Qwen2.5-VL needs [3, B, S] multimodal "
                                 "positions (megagrpo.model.vlm.rope_positions)")
            if decoder_input is None and self.pre_process:
                decoder_input = self.embed(input_ids, pixel_values, image_grid_thw)
            return super().forward(input_ids, position_ids, attention_mask, decoder_input,
                                   *args, **kwargs)

        def embed(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None,
                  image_grid_thw: torch.Tensor | None) -> torch.Tensor:
            """[S, B, H] decoder input: the word embeddings, image pads replaced by the
            merged vision features (in row-major order of the pads, images in order)."""
            emb = self.embedding(input_ids=input_ids, position_ids=None)  # [S, B, H]
            mask = input_ids == self.image_token_id  # [B, S]
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
