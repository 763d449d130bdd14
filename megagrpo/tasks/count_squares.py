"""A synthetic image task with a verifiable answer: count the red squares in a picture ("How
many red squares are in the image?" -> "3"), the images drawn locally with PIL, written as
JSONL prompt files whose records name their image (`images`: paths relative to the file) for a
vision-language model (Qwen2.5-VL, docs/vlm.md).

Each image is a `size` x `size` canvas cut into a grid of cells; `count` cells get a red square
and up to `distractors` others a square of another colour (blue, green, yellow), so reading the
colour matters, not only the shapes. Squares never touch (one cell each, a margin inside the
cell), so the count is the number of red connected components of the picture. Counts are
uniform in [1, max_count]; the held-out split is every image whose (count, layout) hash falls
in `eval_fraction`, decided before drawing, so no held-out picture is trained on.

    python -m megagrpo.tasks.count_squares data/squares   # train.jsonl + eval.jsonl + img/
"""
from __future__ import annotations

import argparse
import json
import random
import zlib
from pathlib import Path

COLOURS = {"red": (220, 30, 30), "blue": (30, 60, 220), "green": (30, 170, 60),
           "yellow": (230, 210, 40)}
"""RGB of each square colour; the background is white."""
QUESTION = "How many red squares are in the image?"


def layout(rng: random.Random, *, grid: int, max_count: int, distractors: int
           ) -> tuple[int, list[tuple[int, str]]]:
    """(count, [(cell, colour)]): `count` red cells and up to `distractors` of other colours,
    distinct cells of a grid x grid board."""
    count = rng.randint(1, max_count)
    others = rng.randint(0, distractors)
    cells = rng.sample(range(grid * grid), count + others)
    colours = ["red"] * count + [rng.choice(["blue", "green", "yellow"]) for _ in range(others)]
    return count, sorted(zip(cells, colours))


def draw(squares: list[tuple[int, str]], *, size: int, grid: int):
    """The picture (PIL RGB image) of `squares` on a size x size white canvas."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), (255, 255, 255))
    pen = ImageDraw.Draw(img)
    cell = size // grid
    margin = max(1, cell // 5)
    for c, colour in squares:
        x, y = (c % grid) * cell, (c // grid) * cell
        pen.rectangle([x + margin, y + margin, x + cell - 1 - margin, y + cell - 1 - margin],
                      fill=COLOURS[colour])
    return img


def records(n: int, *, seed: int = 0, size: int = 16, grid: int = 4, max_count: int = 4,
            distractors: int = 2) -> list[tuple[dict, object]]:
    """n (record, image) pairs: {"prompt", "answer", "layout"} and the PIL image."""
    if size // grid < 3:
        raise ValueError(f"size={size} / grid={grid}: cells need at least 3 pixels for a square "
                         "with a margin")
    if max_count + distractors > grid * grid:
        raise ValueError(f"max_count + distractors = {max_count + distractors} squares do not fit "
                         f"a {grid}x{grid} grid")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        count, squares = layout(rng, grid=grid, max_count=max_count, distractors=distractors)
        rec = {"prompt": QUESTION, "answer": str(count),
               "layout": ";".join(f"{c}:{k}" for c, k in squares)}
        out.append((rec, draw(squares, size=size, grid=grid)))
    return out


def is_eval(rec: dict, eval_fraction: float) -> bool:
    """Held-out membership by a stable hash (CRC32) of the layout."""
    return zlib.crc32(rec["layout"].encode()) % 1000 < eval_fraction * 1000


def write(out_dir: str | Path, n: int = 512, *, seed: int = 0, eval_fraction: float = 0.1,
          **kw) -> tuple[Path, Path]:
    """Writes out_dir/train.jsonl, out_dir/eval.jsonl and the images under out_dir/img/ (PNG);
    each record's `images` holds its image's path relative to out_dir. Returns the two paths."""
    out = Path(out_dir)
    (out / "img").mkdir(parents=True, exist_ok=True)
    split: dict[bool, list[dict]] = {False: [], True: []}
    for i, (rec, img) in enumerate(records(n, seed=seed, **kw)):
        name = f"img/{i:05d}.png"
        img.save(out / name)
        split[is_eval(rec, eval_fraction)].append(dict(rec, images=[name]))
    paths = (out / "train.jsonl", out / "eval.jsonl")
    for path, recs in zip(paths, (split[False], split[True])):
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return paths


VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""Qwen's vision tokens, as its tokenizer spells them, after the characters of
`write_tokenizer`'s vocabulary (in this order)."""


def write_tokenizer(folder: str | Path, *, patch_size: int, merge_size: int,
                    min_pixels: int, max_pixels: int) -> int:
    """A character-level HF tokenizer (<pad> 0, <unk> 1, <|im_start|> 2, <|im_end|> 3 = EOS,
    printable ASCII and newline, then `VISION_TOKENS`) and transformers' Qwen2-VL image
    processor at the given patch sizes (2 frames) and pixel limits, saved to `folder`: what a
    Qwen2.5-VL made from scratch needs as data.tokenizer (the demo's). Returns the vocab size."""
    from tokenizers import Regex, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    words = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>",
             *(chr(c) for c in range(32, 127)), "\n", *VISION_TOKENS]
    raw = RawTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", unk_token="<unk>",
                                  eos_token="<|im_end|>",
                                  additional_special_tokens=["<|im_start|>", *VISION_TOKENS])
    tok.save_pretrained(str(folder))
    Qwen2VLImageProcessorPil(patch_size=patch_size, temporal_patch_size=2,
                             merge_size=merge_size, min_pixels=min_pixels,
                             max_pixels=max_pixels).save_pretrained(str(folder))
    return len(words)


def write_demo(cfg) -> str:
    """The VLM demo's inputs, generated offline into the folders its recipe names (a
    `TrainConfig`: data.path's folder gets train.jsonl + eval.jsonl + img/, data.tokenizer the
    tokenizer and image processor at model.vision's patch sizes). The pictures are those of
    `write` with the settings of DEMO below at a side of 4 vision patches (model.vision's
    patch_size x spatial_merge_size x 2). Deterministic: the same files every time. Returns a
    console line."""
    data = Path(cfg.data.path).expanduser()
    if data.name != "train.jsonl" or Path(cfg.data.eval_path).expanduser() != (
            data.parent / "eval.jsonl"):
        raise ValueError(f"data.path={cfg.data.path!r}, data.eval_path={cfg.data.eval_path!r}: "
                         "the VLM demo writes DIR/train.jsonl and DIR/eval.jsonl; name them so")
    v = cfg.model.vision
    side = 2 * v.patch_size * v.spatial_merge_size  # 2x2 image tokens, a grid cell per patch
    vocab = write_tokenizer(cfg.data.tokenizer, patch_size=v.patch_size,
                            merge_size=v.spatial_merge_size, min_pixels=side * side,
                            max_pixels=side * side)
    if cfg.model.vocab_size < vocab:
        raise ValueError(f"model.vocab_size={cfg.model.vocab_size}: the demo's tokenizer has "
                         f"{vocab} tokens; set model.vocab_size >= {vocab}")
    train, evals = write(data.parent, DEMO["n"], seed=DEMO["seed"],
                         eval_fraction=DEMO["eval_fraction"], size=side, grid=4,
                         max_count=DEMO["max_count"], distractors=DEMO["distractors"])
    n_train = len(train.read_text().splitlines())
    n_eval = len(evals.read_text().splitlines())
    return (f"count_squares: {n_train} training and {n_eval} held-out pictures of {side}x{side} "
            f"pixels in {data.parent}; tokenizer and image processor in {cfg.data.tokenizer}")


DEMO = dict(n=1600, seed=0, eval_fraction=0.125, max_count=4, distractors=2)
"""The VLM demo's pictures (examples/vlm-demo.yaml): a 4x4 grid of cells of one vision patch
each (the picture's side is 4 patches: 2x2 image tokens after the merge), 1-4 red squares and
up to 2 distractors."""


def chance(eval_path: str | Path) -> float:
    """The best held-out accuracy any answer that ignores the picture can have: every record
    asks the same question, so a text-only (or blank-image) policy gives every prompt the same
    greedy answer; its accuracy is that answer's share, at most the largest one."""
    answers = [json.loads(line)["answer"] for line in Path(eval_path).read_text().splitlines()]
    return max(answers.count(a) for a in set(answers)) / len(answers)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m megagrpo.tasks.count_squares",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", help="folder for train.jsonl, eval.jsonl and img/")
    ap.add_argument("-n", type=int, default=512, help="pictures in all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size", type=int, default=16, help="picture side in pixels")
    ap.add_argument("--grid", type=int, default=4, help="cells per side")
    ap.add_argument("--max-count", type=int, default=4, help="most red squares")
    args = ap.parse_args(argv)
    train, evals = write(args.out_dir, args.n, seed=args.seed, size=args.size, grid=args.grid,
                         max_count=args.max_count)
    print(f"wrote {train} and {evals}")


if __name__ == "__main__":
    main()
