"""Prompts with images for Qwen2.5-VL (docs/vlm.md): the synthetic count-the-red-squares task
(megagrpo/tasks/count_squares.py) against an independent count of the pictures' red regions,
and the data path (`megagrpo.data.image_prompt`: the image processor, the placeholder
expanded to the image's tokens) against transformers' model and get_rope_index."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megagrpo.data import IMAGE_PLACEHOLDER, image_prompt, load_image_processor, load_images
from megagrpo.tasks import count_squares
from tests.support.tiny import tiny_qwen25_vl, tiny_vl_tokenizer


def red_regions(path) -> int:
    """Red connected components (4-neighbour flood fill) of a PNG, counted from its pixels."""
    from PIL import Image

    a = np.asarray(Image.open(path).convert("RGB")).astype(int)
    red = (a[..., 0] > 150) & (a[..., 1] < 100) & (a[..., 2] < 100)
    seen = np.zeros_like(red)
    n = 0
    for y, x in zip(*np.nonzero(red)):
        if seen[y, x]:
            continue
        n += 1
        stack = [(y, x)]
        while stack:
            i, j = stack.pop()
            if 0 <= i < red.shape[0] and 0 <= j < red.shape[1] and red[i, j] and not seen[i, j]:
                seen[i, j] = True
                stack += [(i + 1, j), (i - 1, j), (i, j + 1), (i, j - 1)]
    return n


def test_count_squares_answers_are_the_pictures_red_squares(tmp_path):
    """Every record's answer is the number of red regions its PNG holds; train and eval share
    no layout; the files name their images relative to the folder."""
    train, evals = count_squares.write(tmp_path, 60, seed=3, eval_fraction=0.2)
    recs = {p: [json.loads(x) for x in p.read_text().splitlines()] for p in (train, evals)}
    assert len(recs[train]) + len(recs[evals]) == 60 and recs[evals] and recs[train]
    assert not {r["layout"] for r in recs[train]} & {r["layout"] for r in recs[evals]}
    counts = set()
    for r in recs[train] + recs[evals]:
        assert r["prompt"] == count_squares.QUESTION and len(r["images"]) == 1
        assert int(r["answer"]) == red_regions(tmp_path / r["images"][0]), r
        counts.add(int(r["answer"]))
    assert counts == {1, 2, 3, 4}


def test_image_prompt_feeds_the_model_as_transformers_reads_it(tmp_path):
    """A task record -> chat-templated ids with the placeholder -> `image_prompt`: the pads
    fit the processor's grid as transformers' model requires (its forward checks the count),
    logits finite, and megagrpo's 3-D positions equal transformers' get_rope_index; a bigger
    picture gives more image tokens."""
    from transformers import AutoTokenizer

    from megagrpo.hf.config import model_config_from_hf
    from megagrpo.parallel.mrope import rope_index

    ref = tiny_qwen25_vl(tmp_path / "m")
    tiny_vl_tokenizer(tmp_path / "m", min_pixels=16, max_pixels=1024)
    model = model_config_from_hf(tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    proc = load_image_processor(tmp_path / "m")
    count_squares.write(tmp_path / "d", 4, seed=1, eval_fraction=0.0, size=16)
    count_squares.write(tmp_path / "big", 1, seed=1, eval_fraction=0.0, size=24, grid=4)
    rec = json.loads((tmp_path / "d" / "train.jsonl").read_text().splitlines()[0])
    big = json.loads((tmp_path / "big" / "train.jsonl").read_text().splitlines()[0])
    text = tok.apply_chat_template([{"role": "user", "content": IMAGE_PLACEHOLDER + rec["prompt"]}],
                                   tokenize=False, add_generation_prompt=True)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    tokens = []
    for folder, r in ((tmp_path / "d", rec), (tmp_path / "big", big)):
        ids, pix, grid = image_prompt(prompt, load_images(r["images"], folder), proc,
                                      image_token_id=model.image_token_id,
                                      merge_size=model.vision.spatial_merge_size)
        x = torch.tensor([ids])
        mm = (x == model.image_token_id).int()
        with torch.no_grad():
            logits = ref(input_ids=x, pixel_values=pix, image_grid_thw=grid,
                         mm_token_type_ids=mm).logits
        assert torch.isfinite(logits).all()
        want, _ = ref.model.get_rope_index(x, mm, image_grid_thw=grid)
        assert torch.equal(rope_index(x[0], grid, model)[0], want[:, 0])
        tokens.append(int(mm.sum()))
    assert tokens == [16, 36]  # 16x16 px: 8x8 patches / 2x2 merge; 24x24 px: 12x12 / 4


def test_bad_image_inputs_are_refused(tmp_path):
    proc_dir = tmp_path / "m"
    tiny_vl_tokenizer(proc_dir)
    proc = load_image_processor(proc_dir)
    (tmp_path / "bad.png").write_bytes(b"not a picture")
    with pytest.raises(ValueError, match=r"bad\.png' does not open as an image"):
        load_images(["bad.png"], tmp_path)
    count_squares.write(tmp_path / "d", 1, seed=0, eval_fraction=0.0)
    img = load_images(["img/00000.png"], tmp_path / "d")
    with pytest.raises(ValueError, match=r"2 image placeholders .* 1 images"):
        image_prompt([5, 252, 6, 252], img, proc, image_token_id=252, merge_size=2)
    with pytest.raises(ValueError, match=r"no preprocessor_config\.json"):
        load_image_processor(tmp_path)


def test_file_task_resolves_image_paths_against_the_file(tmp_path):
    """A record's `images` are paths relative to its data file, whatever the working folder;
    a field that is not a list of paths is refused, named."""
    from megagrpo.config.data import DataConfig
    from megagrpo.tasks import build_task

    tiny_vl_tokenizer(tmp_path / "tok")
    train, _ = count_squares.write(tmp_path / "data", 8, seed=0, eval_fraction=0.0)
    data = DataConfig(task="file", path=str(train), tokenizer=str(tmp_path / "tok"))
    task = build_task(data)
    for e in task.train:
        (path,) = e.record["images"]
        assert path == str(tmp_path / "data" / "img" / path.rsplit("/", 1)[1])
        assert load_images([path])[0].size == (16, 16)
    train.write_text(json.dumps({"prompt": "q", "answer": "1", "images": "img/00000.png"}) + "\n")
    with pytest.raises(ValueError, match=r"record 1: 'images' must be a list of image paths"):
        build_task(data)
