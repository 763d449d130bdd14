"""`python -m megagrpo verify --hf DIR [--tp N --pp N] [--dtype ...]`: is megatron's model of an
HF checkpoint the model transformers runs?

On every rank of the layout: the GPTModel stage is loaded from the HF folder (as `run.init`
does) and
  1. its weights are streamed back to HF names (the exporter / vLLM feed) and compared with the
     checkpoint's tensors, bitwise (in the model's dtype);
  2. a few prompts go through megatron's schedule (PP stages pass activations, the vocab shards
     are gathered over TP); one rank runs transformers' forward on the same prompts and reports
     the max relative logits error (max |megatron - transformers| / max |transformers|, per
     prompt) and the greedy agreement (share of positions whose argmax is the same).
The exit status is 1 when the round trip is not exact or the logits error exceeds the tolerance:
1e-5 in float32; in bfloat16 (both sides in bf16, rounded differently) 5e-2, ~3.5x the
largest error measured on the test models (1.4e-2; docs/usage.md).

Prompts: the folder's tokenizer encodes a few fixed sentences when it has one; else (and in
addition, with --seq-len) seeded random token ids, so long positions are covered too. A
vision-language model (Qwen2.5-VL) is checked on seeded prompts with 0, 1 and 2 random images
of different patch grids (`vlm_prompts`), its logits against transformers'
`Qwen2_5_VLForConditionalGeneration` given the same pixels.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from megagrpo.config.model import ModelConfig, ParallelConfig

log = logging.getLogger("megagrpo")

TOLERANCE = {"float32": 1e-5, "bfloat16": 5e-2, "float16": 5e-2}
"""Default max relative logits error per --dtype."""
TEXTS = ("The capital of France is",
         "Question: what is 12 + 7? Answer step by step.",
         "def fibonacci(n):\n    if n < 2:\n        return n\n",
         "In 1905 Albert Einstein published four papers that")


@dataclass
class Report:
    """What one verification found (complete on the reporting rank only)."""

    tensors: int = 0
    """HF tensors compared after the round trip."""
    mismatched: list[str] = field(default_factory=list)
    """HF names whose round-tripped tensor is not bitwise equal to the checkpoint's."""
    max_rel_error: float = 0.0
    """max over prompts of max |megatron - transformers| / max |transformers| (logits)."""
    agree: int = 0
    """Positions whose argmax (the greedy next token) is the same in both."""
    positions: int = 0

    def ok(self, tolerance: float) -> bool:
        return not self.mismatched and self.max_rel_error <= tolerance


def prompts(hf_dir: str | os.PathLike, vocab: int, *, n: int, seq_len: int,
            seed: int = 0) -> list[torch.Tensor]:
    """[S] token-id tensors: the fixed sentences through the folder's tokenizer (if any), then
    `n` seeded random sequences of lengths spread up to `seq_len`."""
    from megagrpo.hf.export import has_hf_tokenizer

    out: list[torch.Tensor] = []
    if has_hf_tokenizer(hf_dir):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(hf_dir))
        out += [torch.tensor(tok(t)["input_ids"]) for t in TEXTS]
        out = [ids for ids in out if 0 < len(ids) and int(ids.max()) < vocab]
    gen = torch.Generator().manual_seed(seed)
    for i in range(n):
        length = max(2, seq_len * (i + 1) // n)
        out.append(torch.randint(0, vocab, (length,), generator=gen))
    return out


def megatron_logits(gpt: torch.nn.Module, ids: torch.Tensor, vocab: int) -> torch.Tensor | None:
    """[S, vocab] float32 logits of one sequence through megatron's schedule, TP-gathered, on
    the last pipeline stage (None elsewhere). Collective over the model-parallel group."""
    from megatron.core import parallel_state as ps

    from megagrpo.model.optim import forward_backward

    def step(batch, model):
        out = model(batch, torch.arange(batch.shape[1], device=batch.device)[None], None)
        return out, lambda o: (o.sum() * 0, {"logits": o[0].detach()})

    device = next(gpt.parameters()).device
    got = forward_backward(gpt, step, [ids[None].to(device)], 1, seq_length=len(ids),
                           micro_batch_size=1, forward_only=True)
    if not got:
        return None
    local = got[0]["logits"].float()
    group = ps.get_tensor_model_parallel_group()
    if dist.get_world_size(group) > 1:
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        local = torch.cat(parts, dim=-1)
    return local[:, :vocab].cpu()


@dataclass
class VLMPrompt:
    """One vision-language prompt: token ids with the image pads, and its images."""

    ids: torch.Tensor
    """[S] token ids; image i fills `image_tokens(grid_thw)[i]` image-pad tokens."""
    pixel_values: torch.Tensor | None
    """[P, C*t*p*p] flattened patches of the images, in prompt order (None: no image)."""
    grid_thw: torch.Tensor | None
    """[n, 3] patches along time, height, width per image."""


def vlm_prompts(model: ModelConfig, *, seed: int = 0, text: int = 6) -> list[VLMPrompt]:
    """Prompts with 0, 1 and 2 images (patch grids 1 x 2m x 2m, 1 x 4m x 2m and 1 x 2m x 4m for
    merge size m, so that window attention sees one and two windows), random text ids around
    them (no special token), images wrapped in vision start / end tokens."""
    v, m = model.vision, model.vision.spatial_merge_size
    special = {model.image_token_id, model.video_token_id, model.vision_start_token_id,
               model.vision_end_token_id}
    pool = torch.tensor([i for i in range(model.vocab_size) if i not in special])
    gen = torch.Generator().manual_seed(seed)
    patch = v.in_channels * v.temporal_patch_size * v.patch_size ** 2

    def words() -> list[int]:
        return pool[torch.randint(0, len(pool), (text,), generator=gen)].tolist()

    out = []
    for grids in ([], [(1, 2 * m, 2 * m)], [(1, 4 * m, 2 * m), (1, 2 * m, 4 * m)]):
        ids = words()
        for t, h, w in grids:
            ids += [model.vision_start_token_id] + [model.image_token_id] * (t * h * w // m ** 2)
            ids += [model.vision_end_token_id] + words()
        n = sum(t * h * w for t, h, w in grids)
        out.append(VLMPrompt(torch.tensor(ids),
                             torch.randn(n, patch, generator=gen) if grids else None,
                             torch.tensor(grids) if grids else None))
    return out


def vlm_megatron_logits(gpt: torch.nn.Module, prompt: VLMPrompt, model: ModelConfig
                        ) -> torch.Tensor:
    """[S, vocab] float32 logits of one prompt through the VLM (pp = 1), gathered over TP.
    Collective over the TP group."""
    from megatron.core import parallel_state as ps

    from megagrpo.model.vlm import rope_positions
    from megagrpo.runtime.cpu_compat import megatron_scope

    device = next(gpt.parameters()).device
    ids = prompt.ids[None].to(device)
    pos = rope_positions(prompt.ids[None], prompt.grid_thw, model).to(device)
    pix = None if prompt.pixel_values is None else prompt.pixel_values.to(device)
    grid = None if prompt.grid_thw is None else prompt.grid_thw.to(device)
    with megatron_scope():
        local = gpt(ids, pos, None, pixel_values=pix, image_grid_thw=grid)[0].float()
    group = ps.get_tensor_model_parallel_group()
    if dist.get_world_size(group) > 1:
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        local = torch.cat(parts, dim=-1)
    return local[:, :model.vocab_size].cpu()


def vlm_reference_logits(ref, prompt: VLMPrompt, model: ModelConfig) -> torch.Tensor:
    """[S, vocab] logits of transformers' Qwen2.5-VL on the same prompt (its own 3-D positions,
    from `mm_token_type_ids`)."""
    device = next(ref.parameters()).device
    ids = prompt.ids[None].to(device)
    kwargs = {}
    if prompt.pixel_values is not None:
        dtype = next(ref.parameters()).dtype
        kwargs = dict(pixel_values=prompt.pixel_values.to(device, dtype),
                      image_grid_thw=prompt.grid_thw.to(device),
                      mm_token_type_ids=(ids == model.image_token_id).int())
    return ref(input_ids=ids, **kwargs).logits[0].float().cpu()


def round_trip(gpt: torch.nn.Module, hf_dir: str | os.PathLike, model: ModelConfig,
               parallel: ParallelConfig, report: Report, compare: bool) -> None:
    """Streams the shards back to HF tensors and compares each with the checkpoint's (on the
    `compare` rank; every rank of the model-parallel group drives the stream)."""
    from megagrpo.hf import HFCheckpoint, hf_shapes
    from megagrpo.model.gpt import DTYPE
    from megagrpo.sync.source import iter_hf_weights

    ckpt, shapes, dtype = HFCheckpoint(hf_dir), hf_shapes(model), DTYPE[model.dtype]
    seen = set()
    for name, tensor in iter_hf_weights(gpt, model, parallel):
        if not compare:
            continue
        seen.add(name)
        src = ckpt.rows(name, 0, shapes[name][0], name).to(dtype)
        report.tensors += 1
        if not torch.equal(src, tensor.cpu()):
            report.mismatched.append(name)
    if compare:
        report.mismatched += sorted(set(shapes) - seen)  # never streamed


def hf_reference(hf_dir: str | os.PathLike, dtype: str, device: torch.device):
    """transformers' model of the folder (Qwen2.5-VL: its conditional-generation class)."""
    from transformers import AutoModelForCausalLM, Qwen2_5_VLForConditionalGeneration

    from megagrpo.hf.config import model_config_from_hf
    from megagrpo.model.gpt import DTYPE

    vlm = model_config_from_hf(hf_dir).is_vlm
    cls = Qwen2_5_VLForConditionalGeneration if vlm else AutoModelForCausalLM
    return cls.from_pretrained(str(hf_dir), dtype=DTYPE[dtype]).to(device).eval()


def compare_logits(report: Report, ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Adds one prompt's [S, V] logits pair to the report."""
    err = (ours - ref).abs().max() / ref.abs().max().clamp_min(1e-30)
    report.max_rel_error = max(report.max_rel_error, float(err))
    report.agree += int((ours.argmax(-1) == ref.argmax(-1)).sum())
    report.positions += ours.shape[0]


def verify(hf_dir: str | os.PathLike, model: ModelConfig, parallel: ParallelConfig, *,
           n_prompts: int = 4, seq_len: int = 64, tolerance: float | None = None) -> int:
    """Runs on every rank; starts the process group if none is up (a later call may take
    another layout of the same world) and leaves it up (`megagrpo.runtime.distributed.shutdown`).
    Returns the exit status, the same on all ranks, and prints the figures on one rank."""
    from megagrpo.hf import load_hf_weights
    from megagrpo.model.gpt import build_model
    from megagrpo.runtime.distributed import init_distributed

    tol = TOLERANCE[model.dtype] if tolerance is None else tolerance
    info = init_distributed(parallel, model)
    reports = info.is_last_stage and info.tp_rank == 0 and info.dp_rank == 0
    gpt = build_model(model, parallel).eval()
    load_hf_weights(gpt, hf_dir, model, parallel, tp_rank=info.tp_rank, pp_rank=info.pp_rank)
    report = Report()
    round_trip(gpt, hf_dir, model, parallel, report, compare=reports)
    ref = hf_reference(hf_dir, model.dtype, info.device) if reports else None
    if model.is_vlm:
        batch = vlm_prompts(model)
        with torch.no_grad():
            for p in batch:
                ours = vlm_megatron_logits(gpt, p, model)
                if ref is not None:
                    compare_logits(report, ours, vlm_reference_logits(ref, p, model))
    else:
        batch = prompts(hf_dir, model.vocab_size, n=n_prompts, seq_len=seq_len)
        with torch.no_grad():
            for ids in batch:
                ours = megatron_logits(gpt, ids, model.vocab_size)
                if ref is not None:
                    want = ref(ids[None].to(info.device)).logits[0].float().cpu()
                    compare_logits(report, ours, want)
    status = torch.tensor([0 if report.ok(tol) else 1])
    if reports:
        print(summary(hf_dir, model, parallel, report, tol, len(batch)), flush=True)
    else:
        status.zero_()
    dist.all_reduce(status, op=dist.ReduceOp.MAX)
    return int(status.item())


def summary(hf_dir: str | os.PathLike, model: ModelConfig, parallel: ParallelConfig,
            r: Report, tol: float, n: int) -> str:
    rope = "" if model.rope_type == "default" else f", {model.rope_type} RoPE"
    trip = (f"bitwise equal ({r.tensors} tensors)" if not r.mismatched else
            f"{len(r.mismatched)} of {r.tensors} tensors differ: {r.mismatched[:4]}")
    share = r.agree / max(r.positions, 1)
    ep = f" ep={parallel.ep}" if parallel.ep > 1 else ""
    lines = [
        f"verify {Path(hf_dir)}: {model.architecture}{rope}, {model.num_layers} layers, "
        f"tp={parallel.tp} pp={parallel.pp}{ep}, {model.dtype}, {n} prompts ({r.positions} tokens)",
        f"  weights HF -> megatron -> HF: {trip}",
        f"  logits vs transformers: max relative error {r.max_rel_error:.2e} (tolerance "
        f"{tol:.0e}); greedy agreement {r.agree}/{r.positions} ({100 * share:.1f}%)",
        "verify: ok" if r.ok(tol) else "verify: FAILED (megatron's model differs from the HF "
        "checkpoint's; do not train on this layout)",
    ]
    return "\n".join(lines)
