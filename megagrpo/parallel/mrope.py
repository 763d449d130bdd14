"""Multimodal RoPE positions (Qwen2.5-VL): [3, S] (temporal, height, width) per sequence, as
transformers' `get_rope_index` computes them from the token ids and each image's patch grid.
Pure arithmetic on the ids and the config: the batch (`megagrpo.parallel.batch.pack`) and the
model (`megagrpo.model.vlm`) both read it."""
from __future__ import annotations

import torch

from megagrpo.config.model import ModelConfig, VisionConfig


def image_tokens(grid_thw: torch.Tensor, vision: VisionConfig) -> torch.Tensor:
    """[n] image-pad tokens each image fills: t * h * w / spatial_merge_size^2."""
    return grid_thw.prod(-1) // vision.spatial_merge_size ** 2


def image_positions(ids: torch.Tensor, image_token_id: int, prompt_len: int | None = None
                    ) -> torch.Tensor:
    """[..., S] bool: the image-pad tokens of the prompt (the first `prompt_len` columns; None:
    all), the positions whose embeddings are image features."""
    is_image = ids == image_token_id
    if prompt_len is not None:
        is_image[..., prompt_len:] = False
    return is_image


def rope_index(ids: torch.Tensor, grid_thw: torch.Tensor | None, model: ModelConfig,
               prompt_len: int | None = None) -> tuple[torch.Tensor, int]:
    """Multimodal RoPE positions of one sequence: ([3, S] long, delta).

    Text tokens advance all three positions together by one. An image at text position p with
    a merged grid (t, h', w') = (t, h/m, w/m) takes positions (p + ti, p + hi, p + wi) over its
    tokens in (t, h, w) row-major order, and the text after it continues at p + max(h', w').
    `delta` = max position + 1 - S (what decoding adds to 1-D positions after the prompt).
    `ids` [S]; `grid_thw` [n, 3] of the images in the order their pads appear (None: none).
    A run of image pads may hold several images back to back: each takes its own token count.
    `prompt_len`: only the first `prompt_len` tokens may be images (a pad the policy sampled
    in its completion is text, as vLLM decodes it; None: the whole sequence is the prompt).
    """
    merge = model.vision.spatial_merge_size
    is_image = image_positions(ids, model.image_token_id, prompt_len)
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
