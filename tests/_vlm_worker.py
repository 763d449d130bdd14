"""Run on local ranks (2 ranks, gloo) by tests/test_vlm.py, one launch for every multi-rank
check of the Qwen2.5-VL model side:
1. `megagrpo verify` of the tiny checkpoint at TP=1 (DP=2) and at TP=2: the HF -> megatron ->
   HF round trip bitwise, logits against transformers' (fp32) on prompts with 0, 1, 2 images;
2. at TP=2, the gradients of one loss (mean next-token cross-entropy over the three prompts)
   against transformers' model in float64, with the vision tower frozen and trained: each
   megatron gradient gathered over TP and mapped to its HF tensors by the parameter layout.
Rank 0 writes {"verify": [status per layout], "grads": {mode: {...}}} to WORK/results.json.
"""
import argparse
import json
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
    # transformers 5 names its modules model.language_model.* / model.visual.*; the checkpoint
    # (and the layout) says model.* / visual.*
    rename = (("model.language_model.", "model."), ("model.visual.", "visual."))
    out = {}
    for n, q in ref.named_parameters():
        if q.grad is not None:
            for old, new in rename:
                n = new + n[len(old):] if n.startswith(old) else n
            out[n] = q.grad
    return out


def grad_check(hf_dir: str, freeze_vision: bool) -> dict:
    model = model_config_from_hf(hf_dir)
    model.freeze_vision = freeze_vision
    parallel = ParallelConfig(tp=2)
    info = init_distributed(parallel, model)
    gpt = build_model(model, parallel)
    load_hf_weights(gpt, hf_dir, model, parallel, tp_rank=info.tp_rank, pp_rank=0)
    prompts = vlm_prompts(model)
    megatron_loss(gpt, prompts, model).backward()
    params = dict(gpt.named_parameters())
    want = reference_grads(hf_dir, prompts, model, freeze_vision)
    errors, missing, unexpected = {}, [], []
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    for spec in param_specs(model, parallel, 0):
        g = params[spec.local].grad
        if g is None:
            missing += list(spec.hf)
            continue
        shards = [g]
        if spec.split_dim is not None:
            shards = [torch.empty_like(g) for _ in range(2)]
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


def run() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--hf", required=True)
    args = ap.parse_args()
    model = model_config_from_hf(args.hf)
    codes = [verify(args.hf, model, ParallelConfig(tp=tp)) for tp in (1, 2)]
    torch.manual_seed(0)
    grads = {mode: grad_check(args.hf, mode == "frozen") for mode in ("frozen", "trained")}
    if dist.get_rank() == 0:
        Path(args.work, "results.json").write_text(json.dumps({"verify": codes,
                                                               "grads": grads}))
    dist.barrier()


if __name__ == "__main__":
    run()
