"""The vision-language demo (examples/vlm-demo.yaml, benchmarks/vlm_demo.py): the inputs
`megagrpo demo` writes for it, the bound on any answer that ignores the picture, and the
README / docs/vlm.md table against the kept runs. The demo's run itself (22 s at its
smallest, alone on 2 cores) is the heavy `test_smallest_demo_run_is_kept_and_tabled`."""
from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

from megagrpo.config.train import load_config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import vlm_demo  # noqa: E402

RECIPE = ROOT / "examples" / "vlm-demo.yaml"


def test_demo_inputs_need_the_picture(tmp_path):
    """`write_demo` writes the recipe's folders: the tokenizer's vision tokens are the ids the
    recipe's model names, the image processor keeps the 16x16 pictures whole (4 image tokens),
    every record asks the same question (so a policy that ignores the picture answers every
    prompt alike), and `chance` is the commonest held-out answer's share, counted by hand."""
    from megagrpo.data import load_image_processor, load_tokenizer
    from megagrpo.tasks.count_squares import chance, write_demo

    cfg = load_config(str(RECIPE), [f"data.path={tmp_path}/d/train.jsonl",
                                    f"data.eval_path={tmp_path}/d/eval.jsonl",
                                    f"data.tokenizer={tmp_path}/tok"])
    write_demo(cfg)
    tok = load_tokenizer(str(tmp_path / "tok"))
    m = cfg.model
    ids = tok.encode("<|vision_start|><|image_pad|><|vision_end|>3")
    assert ids[:3] == [m.vision_start_token_id, m.image_token_id, m.vision_end_token_id]
    assert tok.eos_id == 3 and tok.decode(ids[3:]) == "3"
    from PIL import Image

    proc = load_image_processor(tmp_path / "tok")
    train = [json.loads(x) for x in (tmp_path / "d" / "train.jsonl").read_text().splitlines()]
    evals = [json.loads(x) for x in (tmp_path / "d" / "eval.jsonl").read_text().splitlines()]
    img = Image.open(tmp_path / "d" / evals[0]["images"][0])
    grid = proc(images=[img], return_tensors="pt")["image_grid_thw"][0].tolist()
    assert img.size == (16, 16) and grid == [1, 4, 4]  # 4x4 patches of 4 px: 4 merged tokens
    assert len(train) + len(evals) == 1600 and len({r["prompt"] for r in train + evals}) == 1
    assert not {r["layout"] for r in train} & {r["layout"] for r in evals}
    counts = Counter(r["answer"] for r in evals)
    assert chance(tmp_path / "d" / "eval.jsonl") == max(counts.values()) / len(evals) < 0.35


def _fake_results(folder: Path) -> None:
    for seed, acc in ((2, 0.9), (1, 0.75)):
        (folder / f"seed{seed}-summary.json").write_text(json.dumps(
            {"eval_accuracy_init": 0.25, "eval_accuracy_before": 0.5, "eval_accuracy_after": acc,
             "sft_steps": 100, "steps": 40, "eval_target_accuracy": 0.9,
             "eval_target_step": 40 if acc >= 0.9 else None}))
        (folder / f"seed{seed}-run.json").write_text(json.dumps(
            {"seed": seed, "cpu": "X, AVX2", "wall_seconds_command": 200.4, "load_mean": 3.25,
             "eval_prompts": 10, "chance": 0.3}))


def test_table_rows_by_hand_and_spliced(tmp_path):
    _fake_results(tmp_path)
    lines = vlm_demo.table(tmp_path).splitlines()
    assert lines[2:] == [
        "| X, AVX2 | 1 | 0.250 -> 0.500 -> 0.750 | 0.300 (10 held-out) | 100 + 40 (cap) | "
        "3 min 20 s (3.2) |",
        "| X, AVX2 | 2 | 0.250 -> 0.500 -> 0.900 | 0.300 (10 held-out) | 100 + 40 (reached "
        "0.9) | 3 min 20 s (3.2) |"]
    page = f"a\n{vlm_demo.START}\nold\n{vlm_demo.END}\nb\n"
    assert vlm_demo.spliced(page, "T", "page") == f"a\n{vlm_demo.START}\nT\n{vlm_demo.END}\nb\n"
    with pytest.raises(SystemExit, match="no .* markers"):
        vlm_demo.spliced("a\n", "T", "page")


def test_readme_and_vlm_doc_hold_the_kept_runs_table():
    """README.md and docs/vlm.md show exactly the table of benchmarks/results/vlm_demo_cpu/
    (regenerate: python benchmarks/vlm_demo.py --write README.md docs/vlm.md), and every kept
    seed's held-out accuracy after GRPO beats the picture-blind bound."""
    want = vlm_demo.table()
    assert len(want.splitlines()) >= 4  # two seeds at least
    for page in (ROOT / "README.md", ROOT / "docs" / "vlm.md"):
        text = page.read_text()
        assert vlm_demo.spliced(text, want, page.name) == text, (
            f"{page.name} is stale: python benchmarks/vlm_demo.py --write README.md docs/vlm.md")


@pytest.mark.heavy
def test_smallest_demo_run_is_kept_and_tabled(tmp_path):
    """benchmarks/vlm_demo.py's run at its smallest (2 cold-start steps, 1 GRPO step, 22 s
    with the engines' start): `megagrpo demo` writes the pictures, trains on 2 ranks, and the
    run is kept and tabled (the chance bound and held-out counts from the files it wrote)."""
    d = tmp_path / "data"
    extra = [f"data.path={d}/train.jsonl", f"data.eval_path={d}/eval.jsonl",
             f"data.tokenizer={d}/tok", f"run.out_dir={tmp_path}/run", "cold_start.steps=2",
             "cold_start.target_accuracy=0", "run.steps=1", "eval.every=0"]
    rec = vlm_demo.run_seed(7, tmp_path / "kept", extra=extra)
    s = json.loads((tmp_path / "kept" / "seed7-summary.json").read_text())
    assert s["sft_steps"] == 2 and s["steps"] == 1 and "eval_accuracy_after" in s
    assert rec["eval_prompts"] == 192 and 0.25 <= rec["chance"] < 0.35
    assert len(vlm_demo.table(tmp_path / "kept").splitlines()) == 3
