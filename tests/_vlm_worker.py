"""Run on local ranks (2 ranks, gloo) by tests/test_vlm.py, one launch for every multi-rank
check of the Qwen2.5-VL model side:
1. `megagrpo verify` of the tiny checkpoint at TP=1 (DP=2) and at TP=2: the HF -> megatron ->
   HF round trip bitwise, logits against transformers' (fp32) on prompts with 0, 1, 2 images;
2. at TP=2, the gradients of one loss (mean next-token cross-entropy over the three prompts)
   against transformers' model in float64, with the vision tower frozen and trained: each
   megatron gradient gathered over TP and mapped to its HF tensors by the parameter layout.
3. the trainer's passes on a packed batch of prompts with images (`parallel.batch.pack` with
   `vlm=`, micro-batches of 2 rows, trimmed and length-sorted): at TP=1 (DP=2, vision frozen)
   and TP=2 (vision trained) the scoring pass's completion log-probs against transformers'
   (float64, the same temperature) and the GRPO loss's finalized gradients (megatron's DDP
   main_grad, TP-gathered) against float64 transformers' gradient of the same loss.
4. the cold start's supervised step on prompts with images (`Trainer.sft_step` on
   (prompt, answer, record) pairs whose records name PNG files, micro-batches of 2 rows, one
   prompt without an image) at TP=2 with the tower trained: its NLL per token and its
   gradients against float64 transformers' NLL of the same expanded prompts and pixels.
Rank 0 writes {"verify": [status per layout], "grads": {mode: {...}}, "trainer": {layout: {...}},
"sft": {...}} to WORK/results.json.
"""
import argparse
import json
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megagrpo.config.model import ParallelConfig
from megagrpo.config.params import param_specs
from megagrpo.hf import load_hf_weights, model_config_from_hf, unfuse_shards
from megagrpo.model.gpt import build_model
from megagrpo.model.vlm import rope_positions
from megagrpo.runtime.cpu_compat import megatron_scope
from megagrpo.runtime.distributed import init_distributed
from megagrpo.verify import verify, vlm_prompts


def megatron_loss(gpt, prompts, model):
    """Mean over the prompts of the mean next-token cross-entropy, on TP-gathered logits."""
    from megatron.core import tensor_parallel

    total = 0.0
    for p in prompts:
        pos = rope_positions(p.ids[None], p.grid_thw, model)
        with megatron_scope():
            local = gpt(p.ids[None], pos, None, pixel_values=p.pixel_values,
                        image_grid_thw=p.grid_thw)
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(local)
        total = total + F.cross_entropy(logits[0, :-1, :model.vocab_size], p.ids[1:])
    return total / len(prompts)


def reference_grads(hf_dir, prompts, model, freeze_vision: bool) -> dict[str, torch.Tensor]:
    from transformers import Qwen2_5_VLForConditionalGeneration

    ref = Qwen2_5_VLForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float64)
    ref.model.visual.requires_grad_(not freeze_vision)
    total = 0.0
    for p in prompts:
        ids = p.ids[None]
        kwargs = {}
        if p.pixel_values is not None:
            kwargs = dict(pixel_values=p.pixel_values.double(), image_grid_thw=p.grid_thw,
                          mm_token_type_ids=(ids == model.image_token_id).int())
        logits = ref(input_ids=ids, **kwargs).logits[0]
        total = total + F.cross_entropy(logits[:-1], p.ids[1:])
    (total / len(prompts)).backward()
    return hf_named_grads(ref)


def hf_named_grads(ref) -> dict[str, torch.Tensor]:
    """transformers 5 names its modules model.language_model.* / model.visual.*; the checkpoint
    (and the layout) says model.* / visual.*"""
    rename = (("model.language_model.", "model."), ("model.visual.", "visual."))
    out = {}
    for n, q in ref.named_parameters():
        if q.grad is not None:
            for old, new in rename:
                n = new + n[len(old):] if n.startswith(old) else n
            out[n] = q.grad
    return out


def compare_grads(grads: dict[str, torch.Tensor], want: dict[str, torch.Tensor], model,
                  parallel) -> dict:
    """Each megatron gradient (by local name; None: absent) gathered over TP, mapped to HF
    tensors by the layout, against `want`: max abs error / max abs reference per tensor."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    errors, missing, unexpected = {}, [], []
    for spec in param_specs(model, parallel, 0):
        g = grads.get(spec.local)
        if g is None:
            missing += list(spec.hf)
            continue
        shards = [g]
        if spec.split_dim is not None and parallel.tp > 1:
            shards = [torch.empty_like(g) for _ in range(parallel.tp)]
            dist.all_gather(shards, g.contiguous(), group=group)
        for name, grad in unfuse_shards(shards, spec, model):
            if name not in want:
                unexpected.append(name)
                continue
            ref = want[name]
            errors[name] = float((grad.double() - ref).abs().max() / ref.abs().max())
    vision = [e for n, e in errors.items() if n.startswith("visual.")]
    text = [e for n, e in errors.items() if not n.startswith("visual.")]
    return {"text_max": max(text), "vision_max": max(vision) if vision else None,
            "vision_tensors": len(vision), "text_tensors": len(text),
            "missing": sorted(missing), "unexpected": sorted(unexpected),
            "worst": max(errors, key=errors.get)}


TEMPERATURE = 0.7


def trainer_batch(model):
    """vlm_prompts' three prompts (0, 1, 2 images) twice each with random completions of
    2-5 tokens and random advantages, packed with their images (6 rows)."""
    from megagrpo.parallel.batch import pack

    prompts = vlm_prompts(model, seed=3) * 2
    gen = torch.Generator().manual_seed(4)
    comps = [torch.randint(0, 240, (int(torch.randint(2, 6, (1,), generator=gen)),),
                           generator=gen).tolist() for _ in prompts]
    adv = torch.randn(len(prompts), generator=gen)
    images = [None if p.pixel_values is None else (p.pixel_values, p.grid_thw) for p in prompts]
    batch = pack([p.ids.tolist() for p in prompts], comps, [[0.0] * len(c) for c in comps], adv,
                 pad_id=0, images=images, vlm=model)
    return batch, prompts, comps, adv


def trainer_reference(hf_dir, model, prompts, comps, adv, freeze_vision: bool):
    """float64 transformers: each completion token's log-prob (logits / TEMPERATURE) and the
    gradients of the on-policy GRPO loss (algo.loss_agg=grpo, beta=0): the mean over sequences
    of each one's token mean of -A * log p."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    ref = Qwen2_5_VLForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float64)
    ref.model.visual.requires_grad_(not freeze_vision)
    logps, total = [], 0.0
    for p, c, a in zip(prompts, comps, adv):
        ids = torch.tensor(p.ids.tolist() + c)[None]
        kwargs = {}
        if p.pixel_values is not None:
            kwargs = dict(pixel_values=p.pixel_values.double(), image_grid_thw=p.grid_thw,
                          mm_token_type_ids=(ids == model.image_token_id).int())
        logits = ref(input_ids=ids, **kwargs).logits[0] / TEMPERATURE
        L = len(p.ids)
        lp = torch.log_softmax(logits, -1)[L - 1:L - 1 + len(c)].gather(
            1, torch.tensor(c)[:, None])[:, 0]
        logps.append(lp.detach())
        total = total + (-float(a) * lp).mean()
    (total / len(prompts)).backward()
    return logps, hf_named_grads(ref)


def trainer_check(hf_dir: str, tp: int, freeze_vision: bool) -> dict:
    """The trainer's scoring pass and GRPO gradients on a batch with images at TP=`tp`."""
    from megagrpo.config.train import TrainConfig
    from megagrpo.model.optim import build_optimizer, wrap_ddp, zero_grad
    from megagrpo.runtime.distributed import training_layout
    from megagrpo.train.losses import grpo_loss
    from megagrpo.train.passes import Passes

    model = model_config_from_hf(hf_dir)
    model.freeze_vision = freeze_vision
    cfg = TrainConfig(model=model, parallel=ParallelConfig(tp=tp))
    cfg.compute.micro_batch_size, cfg.compute.kernel_impl = 2, "torch"
    cfg.compute.skip_zero_advantage = False
    cfg.rollout.temperature, cfg.algo.beta = TEMPERATURE, 0.0
    info = init_distributed(cfg.parallel, model)
    ranks, groups = training_layout(cfg.parallel, model, info)
    gpt = build_model(model, cfg.parallel)
    load_hf_weights(gpt, hf_dir, model, cfg.parallel, tp_rank=info.tp_rank, pp_rank=0)
    ddp = wrap_ddp(gpt, cfg.optim)
    opt = build_optimizer(ddp, cfg.optim)
    passes = Passes(cfg, ranks, groups)
    batch, prompts, comps, adv = trainer_batch(model)
    logp = passes.logprobs(ddp, batch)
    m = passes.micro_size(batch.num_seqs)
    plan = passes.plan(batch, m)
    ctx = passes.loss_context(scale=len(plan) * ranks.dp, counts=passes.counts(batch, len(plan)),
                              algo=cfg.algo, inplace_backward=True)
    zero_grad(ddp, opt)
    passes.run(ddp, partial(grpo_loss, ctx), plan, batch.ids.shape[1], m)
    mine = {n: p.main_grad for n, p in gpt.named_parameters() if p.requires_grad}
    want_logp, want = trainer_reference(hf_dir, model, prompts, comps, adv, freeze_vision)
    got = [logp[r, len(p.ids) - 1:len(p.ids) - 1 + len(c)]
           for r, p, c in zip(range(batch.num_seqs), prompts, comps)]
    logp_err = max(float((g.double() - w).abs().max()) for g, w in zip(got, want_logp))
    return {"logp_max_abs": logp_err, "micro_batches": len(plan),
            "mixed": sum(int(mb.batch.images.model_inputs()["pixel_values"] is not None)
                         for mb in plan),
            "grads": compare_grads(mine, want, model, cfg.parallel)}


SFT_PAIRS = (("3", ["a.png"]), ("12", ["b.png"]), ("7", []), ("40", ["c.png"]))
"""The cold-start check's (answer, images) per prompt: one without an image."""
SFT_TEXT = "How many?"
SFT_PROMPT = "<|vision_start|><|image_pad|><|vision_end|>" + SFT_TEXT
SFT_PICTURES = {"a.png": [(0, "red"), (5, "blue")], "b.png": [(3, "red")],
                "c.png": [(1, "red"), (9, "red"), (14, "green")]}
"""count_squares' drawings (16x16 pixels: 16 image tokens each) the check's records name."""


def sft_reference(hf_dir, model, rows, comps) -> tuple[float, dict]:
    """float64 transformers: the NLL per completion token (answer + EOS) over all rows, and
    its gradients (the tower trained)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    ref = Qwen2_5_VLForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float64)
    total, tokens = 0.0, sum(len(c) for c in comps)
    for (ids, image), c in zip(rows, comps):
        full = torch.tensor(ids + c)[None]
        kwargs = {}
        if image is not None:
            kwargs = dict(pixel_values=image[0].double(), image_grid_thw=image[1],
                          mm_token_type_ids=(full == model.image_token_id).int())
        logp = torch.log_softmax(ref(input_ids=full, **kwargs).logits[0], -1)
        L = len(ids)
        total = total - logp[L - 1:L - 1 + len(c)].gather(1, torch.tensor(c)[:, None]).sum()
    loss = total / tokens
    loss.backward()
    return float(loss), hf_named_grads(ref)


def sft_check(hf_dir: str, work: str) -> dict:
    """`Trainer.sft_step` at TP=2 (vision trained) on SFT_PAIRS against `sft_reference`: the
    step's gradients are read where the optimizer would apply them."""
    from types import SimpleNamespace

    import megagrpo.train.trainer as trainer_mod
    from megagrpo.config.train import TrainConfig
    from megagrpo.data import encode_prompt, load_tokenizer
    from megagrpo.model.optim import build_optimizer, wrap_ddp
    from megagrpo.rollout.collect import ImagePrompts
    from megagrpo.runtime.distributed import training_layout
    from megagrpo.tasks.count_squares import draw
    from megagrpo.train.cold_start import encode_completion
    from megagrpo.train.passes import Passes
    from tests.support.tiny import tiny_vl_tokenizer

    model = model_config_from_hf(hf_dir)
    model.freeze_vision = False
    cfg = TrainConfig(model=model, parallel=ParallelConfig(tp=2))
    cfg.compute.micro_batch_size, cfg.compute.kernel_impl = 2, "torch"
    info = init_distributed(cfg.parallel, model)
    folder = Path(work, "sft")  # the tokenizer, image processor and pictures (rank 0 writes)
    if dist.get_rank() == 0:
        tiny_vl_tokenizer(folder)
        for name, squares in SFT_PICTURES.items():
            draw(squares, size=16, grid=4).save(folder / name)
    dist.barrier()
    ranks, groups = training_layout(cfg.parallel, model, info)
    gpt = build_model(model, cfg.parallel)
    load_hf_weights(gpt, hf_dir, model, cfg.parallel, tp_rank=info.tp_rank, pp_rank=0)
    ddp = wrap_ddp(gpt, cfg.optim)
    tok = load_tokenizer(str(folder))
    vision = ImagePrompts.build(model, str(folder))
    pairs = [(SFT_PROMPT if imgs else SFT_TEXT, answer,
              {"images": [str(folder / p) for p in imgs]}) for answer, imgs in SFT_PAIRS]
    tr = SimpleNamespace(passes=Passes(cfg, ranks, groups), tokenizer=tok, cfg=cfg,
                         model_cfg=model, rollouts=SimpleNamespace(vision=vision),
                         tokens=trainer_mod.TokenIds(pad_id=tok.pad_id, eos_id=tok.eos_id,
                                         stop_ids=(tok.eos_id,)),
                         policy=ddp, optimizer=build_optimizer(ddp, cfg.optim), ranks=ranks,
                         groups=groups)
    seen = {}

    def capture(policy, optimizer):  # in place of the step: the gradients it would apply
        seen.update({n: p.main_grad.clone() for n, p in gpt.named_parameters()
                     if p.requires_grad})
        return True, 0.0

    step, trainer_mod.optimizer_step = trainer_mod.optimizer_step, capture
    try:
        nll = trainer_mod.Trainer.sft_step(tr, pairs, 1e-3)
    finally:
        trainer_mod.optimizer_step = step
    _, expanded, images = vision.prepare([encode_prompt(tok, p) for p, _, _ in pairs],
                                         [r for _, _, r in pairs])
    comps = [encode_completion(tok, a, tok.eos_id)[0] for _, a, _ in pairs]
    want_nll, want = sft_reference(hf_dir, model, list(zip(expanded, images)), comps)
    return {"nll": nll, "nll_ref": want_nll, "rows_with_images": sum(i is not None
                                                                     for i in images),
            "grads": compare_grads(seen, want, model, cfg.parallel)}


def grad_check(hf_dir: str, freeze_vision: bool) -> dict:
    model = model_config_from_hf(hf_dir)
    model.freeze_vision = freeze_vision
    parallel = ParallelConfig(tp=2)
    info = init_distributed(parallel, model)
    gpt = build_model(model, parallel)
    load_hf_weights(gpt, hf_dir, model, parallel, tp_rank=info.tp_rank, pp_rank=0)
    prompts = vlm_prompts(model)
    megatron_loss(gpt, prompts, model).backward()
    grads = {n: p.grad for n, p in gpt.named_parameters() if p.grad is not None}
    want = reference_grads(hf_dir, prompts, model, freeze_vision)
    return compare_grads(grads, want, model, parallel)


def run() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--hf", required=True)
    args = ap.parse_args()
    model = model_config_from_hf(args.hf)
    codes = [verify(args.hf, model, ParallelConfig(tp=tp)) for tp in (1, 2)]
    torch.manual_seed(0)
    grads = {mode: grad_check(args.hf, mode == "frozen") for mode in ("frozen", "trained")}
    t0 = time.perf_counter()
    trainer = {"tp1_frozen": trainer_check(args.hf, 1, True),
               "tp2_trained": trainer_check(args.hf, 2, False)}
    trainer_s = time.perf_counter() - t0  # what the trainer part adds to the launch
    t0 = time.perf_counter()
    sft = sft_check(args.hf, args.work)
    sft["seconds"] = time.perf_counter() - t0
    if dist.get_rank() == 0:
        Path(args.work, "results.json").write_text(json.dumps({"verify": codes, "grads": grads,
                                                               "trainer": trainer,
                                                               "trainer_s": trainer_s,
                                                               "sft": sft}))
    dist.barrier()


if __name__ == "__main__":
    run()
