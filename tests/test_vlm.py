"""Qwen2.5-VL on megatron-core (megagrpo/model/vlm.py, docs/vlm.md): 3-D RoPE positions against
transformers' get_rope_index, the config.json reading and writing, the parameter layout against
a checkpoint transformers saved, the refusals before compute, and (one rank launch,
tests/_vlm_worker.py) verify at TP=1 and TP=2 plus gradients at TP=2 against float64
transformers with the vision tower frozen and trained."""
from __future__ import annotations

import json
import re

import pytest
import torch

from megagrpo.config.model import ParallelConfig
from megagrpo.hf.config import hf_config_dict, model_config_from_hf, model_config_from_hf_dict
from tests.support.launch import shared_output
from tests.support.tiny import tiny_qwen25_vl

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """(folder, transformers model) of the tiny random Qwen2.5-VL."""
    d = tmp_path_factory.mktemp("qwen25vl") / "hf"
    return d, tiny_qwen25_vl(d)


def _prompt(model, grids, gen, text=3):
    """Token ids with one vision start / pads / end block per grid, random text around."""
    m = model.vision.spatial_merge_size
    ids = torch.randint(0, 240, (text,), generator=gen).tolist()
    for t, h, w in grids:
        ids += [model.vision_start_token_id] + [model.image_token_id] * (t * h * w // m ** 2)
        ids += [model.vision_end_token_id] + torch.randint(0, 240, (text,), generator=gen).tolist()
    return torch.tensor(ids)


def test_rope_positions_match_transformers(vl):
    """Rows with 0, 1 and 2 images (square, tall, wide, two frames), one at a time and as one
    right-padded batch: every position equals transformers' get_rope_index."""
    from megagrpo.model.vlm import rope_index, rope_positions

    d, ref = vl
    model = model_config_from_hf(d)
    gen = torch.Generator().manual_seed(0)
    rows = [[], [(1, 4, 4)], [(1, 8, 4), (2, 4, 8)]]
    prompts = [_prompt(model, g, gen) for g in rows]
    for ids, grids in zip(prompts, rows):
        grid = torch.tensor(grids) if grids else None
        mm = (ids == model.image_token_id).int()[None]
        want, delta = ref.model.get_rope_index(ids[None], mm, image_grid_thw=grid) if grids \
            else (torch.arange(len(ids)).expand(3, 1, -1), torch.tensor([[0]]))
        got, got_delta = rope_index(ids, grid, model)
        assert torch.equal(got, want[:, 0]), grids
        assert got_delta == int(delta)
    S = max(len(p) for p in prompts)
    batch = torch.zeros(len(prompts), S, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for b, p in enumerate(prompts):
        batch[b, :len(p)], mask[b, :len(p)] = p, 1
    grid = torch.tensor([g for r in rows for g in r])
    mm = (batch == model.image_token_id).int()
    want, _ = ref.model.get_rope_index(batch, mm, image_grid_thw=grid, attention_mask=mask)
    got = rope_positions(batch, grid, model)
    assert torch.equal(got[mask[None].expand(3, -1, -1).bool()],
                       want[mask[None].expand(3, -1, -1).bool()])


def test_rope_index_refuses_pads_that_do_not_fit_the_grids(vl):
    from megagrpo.model.vlm import rope_index

    model = model_config_from_hf(vl[0])
    ids = _prompt(model, [(1, 4, 4)], torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match=r"4 image-pad tokens .*needs 8"):
        rope_index(ids, torch.tensor([[1, 8, 4]]), model)


def test_config_reads_writes_and_reads_back(vl, tmp_path):
    """config.json -> ModelConfig -> config.json that transformers loads -> the same
    ModelConfig; the released checkpoints' flat layout (decoder keys at the top level, RoPE
    type 'mrope' in rope_scaling) reads the same."""
    from transformers import Qwen2_5_VLConfig

    d, _ = vl
    model = model_config_from_hf(d)
    assert (model.architecture, model.qkv_bias, model.mrope_section, model.image_token_id) == \
        ("qwen2_5_vl", True, [4, 6, 6], 252)
    assert (model.vision.depth, model.vision.fullatt_block_indexes) == (2, [1])
    written = hf_config_dict(model)
    assert model_config_from_hf_dict(written, "written") == model
    hf = Qwen2_5_VLConfig(**written)
    assert hf.text_config.rope_parameters["mrope_section"] == [4, 6, 6]
    assert hf.vision_config.out_hidden_size == model.hidden_size
    flat = json.loads((d / "config.json").read_text())
    text = flat.pop("text_config")
    rope = text.pop("rope_parameters")
    text.pop("model_type")
    flat.update(text, rope_theta=rope["rope_theta"],
                rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]})
    assert model_config_from_hf_dict(flat, "flat") == model


def test_layout_is_the_checkpoint_transformers_saved(vl):
    """hf_shapes (the one parameter layout) lists exactly the tensors of the saved folder, the
    vision tower's included, with their shapes."""
    from safetensors import safe_open

    from megagrpo.config.params import hf_shapes

    d, _ = vl
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert hf_shapes(model_config_from_hf(d)) == saved


@pytest.mark.parametrize("change, match", [
    (dict(pp=2), r"parallel\.pp=2 .*set parallel\.pp=1"),
    (dict(cp=2), r"parallel\.cp=2 .*set parallel\.cp=1"),
    (dict(tp=2, sequence_parallel=True), r"parallel\.sequence_parallel=true .*qwen2_5_vl"),
])
def test_layouts_the_vlm_does_not_run_are_refused(vl, change, match):
    model = model_config_from_hf(vl[0])
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**change).validate(model, 4)


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.pop("vision_config"), r"vision_config is missing"),
    (lambda c: c["text_config"]["rope_parameters"].pop("mrope_section"),
     r"mrope_section is missing"),
    (lambda c: c["text_config"]["rope_parameters"].update(mrope_section=[4, 6, 7]),
     r"model\.mrope_section=\[4, 6, 7\]: .*head_dim/2 = 16"),
    (lambda c: c["vision_config"].update(out_hidden_size=32),
     r"model\.vision\.out_hidden_size=32 must equal model\.hidden_size=64"),
    (lambda c: c.update(image_token_id=999), r"model\.image_token_id=999"),
])
def test_bad_configs_are_refused_by_key(vl, edit, match):
    cfg = json.loads((vl[0] / "config.json").read_text())
    edit(cfg)
    with pytest.raises(ValueError, match=match):
        model_config_from_hf_dict(cfg, "config.json")


def test_text_models_refuse_vision_fields():
    from megagrpo.config.model import ModelConfig

    with pytest.raises(ValueError, match=r"model\.mrope_section is set .*'llama' is text-only"):
        ModelConfig(architecture="llama", mrope_section=[8, 4, 4]).validate()


def shared_job(work):
    """This module's part of the shared 2-rank launch (tests/conftest.py): the tiny random
    Qwen2.5-VL under `work`."""
    tiny_qwen25_vl(work / "hf")
    return [ROOT / "tests" / "_vlm_worker.py", "--work", str(work), "--hf", str(work / "hf")], None


def test_verify_and_gradients_at_tp1_and_tp2(shared_launch):
    """In the shared 2-rank launch: verify at TP=1 (DP=2) and TP=2 exits 0 (bitwise round
    trip, logits within 1e-5 of transformers on prompts with 0, 1, 2 images); at TP=2 every
    gradient of a next-token loss equals float64 transformers' within 1e-5 of the tensor's
    largest, the vision tower's included when it trains and absent when frozen. Then the
    trainer's passes on a packed batch with images (3 micro-batches of 2 rows, each holding
    images but the text-only one): completion log-probs within 1e-5 of float64 transformers
    and the GRPO loss's gradients within 1e-5 of the tensor's largest, at TP=1 x DP=2 (vision
    frozen: no vision gradient) and TP=2 (vision trained)."""
    work, _ = shared_launch[__name__]
    out = shared_output(work, 2)
    res = json.loads((work / "results.json").read_text())
    errors = [float(x) for x in re.findall(r"max relative error ([0-9.e+-]+)", out)]
    print("verify max relative logits errors (tp=1, tp=2):", errors)
    print("gradients:", json.dumps(res["grads"]))
    assert res["verify"] == [0, 0], out[-3000:]
    assert "bitwise equal" in out and len(errors) == 2 and max(errors) <= 1e-5
    frozen, trained = res["grads"]["frozen"], res["grads"]["trained"]
    assert frozen["vision_tensors"] == 0 and all(n.startswith("visual.")
                                                 for n in frozen["missing"])
    assert len(frozen["missing"]) == trained["vision_tensors"] > 0
    assert trained["missing"] == [] and trained["unexpected"] == frozen["unexpected"] == []
    assert frozen["text_max"] <= 1e-5 and trained["text_max"] <= 1e-5, res["grads"]
    assert trained["vision_max"] <= 1e-5, trained
    # the trainer's passes on a batch with images (step 1 of docs/vlm.md)
    print("trainer:", json.dumps(res["trainer"]))
    for layout, r in res["trainer"].items():
        assert r["micro_batches"] == 3 and r["mixed"] == 2, (layout, r)  # one text-only
        assert r["logp_max_abs"] <= 1e-5, (layout, r)
        g = r["grads"]
        assert g["unexpected"] == [] and g["text_max"] <= 1e-5, (layout, g)
    frozen, trained = res["trainer"]["tp1_frozen"]["grads"], res["trainer"]["tp2_trained"]["grads"]
    assert frozen["vision_tensors"] == 0 and len(frozen["missing"]) > 0
    assert trained["missing"] == [] and trained["vision_max"] <= 1e-5, trained


def test_cold_start_step_with_images_equals_float64_transformers(shared_launch):
    """In the shared launch: the cold start's supervised step (`Trainer.sft_step`) on four
    (prompt, answer, record) pairs, three records naming a picture and one without, at TP=2
    with the tower trained: its NLL per completion token equals float64 transformers' on the
    same expanded prompts and pixels within 1e-6, and every gradient (decoder and vision
    tower) within 1e-5 of the tensor's largest."""
    work, _ = shared_launch[__name__]
    sft = json.loads((work / "results.json").read_text())["sft"]
    print("cold start step:", json.dumps(sft))
    assert sft["rows_with_images"] == 3
    assert abs(sft["nll"] - sft["nll_ref"]) <= 1e-6 * max(1.0, sft["nll_ref"]), sft
    g = sft["grads"]
    assert g["missing"] == [] and g["unexpected"] == [], g
    assert g["vision_tensors"] > 0 and g["text_max"] <= 1e-5 and g["vision_max"] <= 1e-5, g


def test_planner_counts_the_vision_tower(vl):
    """The planner's counts include the replicated tower (whole on every TP rank) and leave a
    frozen one out of the gradients and the optimizer state."""
    import dataclasses

    from megagrpo.plan.memory import frozen_params, stage_params, total_params, vision_params

    d, ref = vl
    m = model_config_from_hf(d)
    assert total_params(m) == sum(p.numel() for p in ref.parameters())
    assert vision_params(m) == sum(p.numel() for p in ref.model.visual.parameters()) > 0
    text_tp2 = stage_params(dataclasses.replace(m, architecture="qwen2", vision=None,
                                                mrope_section=[]), ParallelConfig(tp=2), 0)
    assert stage_params(m, ParallelConfig(tp=2), 0) == text_tp2 + vision_params(m)
    assert frozen_params(m, 0) == vision_params(m)
    assert frozen_params(dataclasses.replace(m, freeze_vision=False), 0) == 0


@pytest.mark.parametrize("change, match", [
    ({"rollout.placement": "separate", "rollout.rollout_ranks": 1},
     r"rollout\.placement='separate' with model\.architecture='qwen2_5_vl'"),
    ({"rollout.max_staleness": 1}, r"rollout\.max_staleness=1 .*checkpointed without"),
    ({"rollout.inflight_updates": True}, r"rollout\.inflight_updates=true .*no images"),
    ({"rollout.tensor_parallel_size": 2}, r"rollout\.tensor_parallel_size=2 .*engine TP 1"),
    ({"compute.pack_sequences": True}, r"compute\.pack_sequences=true .*1-D"),
    ({"compute.balance_tokens": True}, r"compute\.balance_tokens=true .*images"),
    ({"cold_start.steps": 2}, r"cold_start\.steps=2 .*no images"),
])
def test_vlm_training_layouts_that_do_not_carry_images_are_refused(vl, change, match):
    """A Qwen2.5-VL trains colocated and synchronous (tests/test_vlm_rollout.py runs it); what
    does not carry the images yet is refused before compute, by field."""
    from megagrpo.config.train import TrainConfig

    TrainConfig(model=model_config_from_hf(vl[0])).validate(2)  # colocated, sync: runs
    cfg = TrainConfig(model=model_config_from_hf(vl[0]))
    for key, value in change.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    with pytest.raises(ValueError, match=match):
        cfg.validate(2)


def _image(seed: int, size=(8, 8)):
    import numpy as np
    from PIL import Image

    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(size[1], size[0], 3) * 255).astype("uint8"))


@pytest.mark.parametrize("snapshot_has_processor", [True, False])
def test_export_writes_what_a_vlm_folder_needs(tmp_path, snapshot_has_processor):
    """convert --from-hf keeps the source's image processor beside the tokenizer; the export
    (`finish_hf_export`) returns it (or, when the snapshot holds none, writes transformers'
    default at the model's patch sizes) and the ids into text_config too: the exported folder
    loads in transformers (tokenizer, image processor, model) and its logits on a prompt with
    an image are the source model's with the source's processor."""
    import shutil

    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from megagrpo.hf.export import finish_hf_export, save_hf_source_tokenizer
    from tests.support.tiny import tiny_vl_tokenizer

    src, ckpt, out = tmp_path / "src", tmp_path / "ckpt", tmp_path / "out"
    ref = tiny_qwen25_vl(src)
    tiny_vl_tokenizer(src, min_pixels=16, max_pixels=256)
    if not snapshot_has_processor:
        (src / "preprocessor_config.json").unlink()
    assert save_hf_source_tokenizer(ckpt, src)
    out.mkdir()
    for name in ("config.json", "model.safetensors"):  # what the weight export writes
        shutil.copyfile(src / name, out / name)
    line = finish_hf_export(out, ckpt)
    assert ("preprocessor_config.json" in line) != snapshot_has_processor, line
    text_config = json.loads((out / "config.json").read_text())["text_config"]
    tok = AutoTokenizer.from_pretrained(out)
    assert text_config["eos_token_id"] == tok.eos_token_id == 3
    proc = AutoImageProcessor.from_pretrained(out)
    assert (proc.patch_size, proc.temporal_patch_size, proc.merge_size) == (2, 2, 2)
    if snapshot_has_processor:
        assert (proc.size["shortest_edge"], proc.size["longest_edge"]) == (16, 256)  # not defaults
    images = proc(images=[_image(0)], return_tensors="pt")
    grid = images["image_grid_thw"]
    pads = int(grid.prod()) // 4
    ids = tok("ab<|vision_start|>" + "<|image_pad|>" * pads + "<|vision_end|>cd",
              return_tensors="pt")["input_ids"]
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(out).eval()
    with torch.no_grad():
        got = model(input_ids=ids, **images).logits
        want = ref(input_ids=ids, **images).logits
    assert torch.equal(got, want)


def test_docs_table_is_the_results_table():
    """docs/vlm.md's figures are benchmarks/vlm_checks.py --table of the committed results
    (generated, never typed in)."""
    import importlib.util

    from tests.support.docs import assert_generated_table

    spec = importlib.util.spec_from_file_location("bench_vlm_checks",
                                                  ROOT / "benchmarks" / "vlm_checks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert_generated_table(ROOT / "docs" / "vlm.md", "<!-- vlm table: generated by",
                           "<!-- end of vlm table -->",
                           mod.table(str(ROOT / "benchmarks" / "results" / "vlm_cpu.jsonl")))


def test_micro_batches_keep_each_rows_images(vl):
    """pack(images=, vlm=) then every plan (trimmed and length-sorted, consecutive rows, a
    selection of rows): each micro-batch's images are its own rows' (their pads equal the
    grids' token counts, row by row, and the pixels are the ones given for that sequence), and
    its positions are rope_index of each row."""
    from megagrpo.parallel.batch import pack, plan_micro_batches
    from megagrpo.parallel.mrope import image_tokens, rope_index
    from megagrpo.verify import vlm_prompts

    model = model_config_from_hf(vl[0])
    prompts = vlm_prompts(model, seed=5) * 2
    comps = [[7] * (2 + i) for i in range(len(prompts))]
    images = [None if p.pixel_values is None else (p.pixel_values + i, p.grid_thw)
              for i, p in enumerate(prompts)]  # + i: each sequence's pixels differ
    batch = pack([p.ids.tolist() for p in prompts], comps, [[0.0] * len(c) for c in comps],
                 torch.ones(len(prompts)), pad_id=0, multiple=4, images=images, vlm=model)
    assert batch.num_seqs == 8 and len(batch.images) == 8
    plans = [plan_micro_batches(batch, 3, token_budget=60),
             plan_micro_batches(batch, 3, trim=False)]
    for plan in plans:
        for mb in plan:
            b = mb.batch
            for j, r in enumerate(mb.index.tolist()):
                pads = int((b.ids[j] == model.image_token_id).sum())
                grid = b.images.grid_thw[j]
                assert pads == int(image_tokens(grid, model.vision).sum()) if grid.shape[0] \
                    else pads == 0
                if r < len(prompts):  # a real row: its own sequence's pixels
                    want = images[r]
                    assert (want is None and b.images.pixel_values[j].shape[0] == 0) or \
                        torch.equal(b.images.pixel_values[j], want[0])
                    n = int(b.lengths[j])
                    pos, _ = rope_index(b.ids[j, :n], grid if grid.shape[0] else None, model)
                    assert torch.equal(b.positions[j, :n].T, pos)
            inputs = b.images.model_inputs()
            total = int((b.ids == model.image_token_id).sum())
            assert (inputs["pixel_values"] is None) == (total == 0)
            if total:
                assert int(image_tokens(inputs["image_grid_thw"], model.vision).sum()) == total


def test_token_balancing_refuses_rows_with_images(vl):
    """Moving rows between DP replicas does not carry Batch.images: refused by its field
    before any collective (and a single replica, which moves nothing, runs)."""
    from megagrpo.parallel.batch import pack
    from megagrpo.train.balance import balance_batch
    from megagrpo.verify import vlm_prompts

    model = model_config_from_hf(vl[0])
    p = vlm_prompts(model)[1]
    batch = pack([p.ids.tolist()], [[5, 6]], [[0.0, 0.0]], torch.ones(1), pad_id=0,
                 images=[(p.pixel_values, p.grid_thw)], vlm=model)
    kw = dict(num_minibatches=1, per_micro=1, pad_id=0, dp_rank=0)
    assert balance_batch(batch, dp=1, **kw)[0] is batch
    with pytest.raises(ValueError, match=r"compute\.balance_tokens=false"):
        balance_batch(batch, dp=2, **kw)
