"""A LoRA checkpoint as an HF base folder plus a PEFT adapter folder (`convert --peft-adapter`).

The base folder holds the checkpoint's base weights W, unmerged (after a reference reset that
is the merged base W0 + s B_old A_old the run continued from, not the model the run started
from): `peft` loading the adapter onto it computes W x + s B A x, the policy, so its logits equal
the merged export's (W + s B A). The adapter folder is peft's own format: `adapter_config.json`
(r, lora_alpha, the HF target modules) and `adapter_model.safetensors` with one
`base_model.model.<HF module>.lora_A.weight` [r, in] / `.lora_B.weight` [out, r] pair per
projection.

megagrpo's fused layers carry one adapter over the fused output (`megagrpo.lora.layers`): the fused
QKV's A is shared by q, k and v and its B has the weight's row layout (interleaved per KV group),
fc1's A is shared by gate and up and its B is cat(gate, up) per TP rank. peft has one adapter
per projection, so the export repeats A for each part and splits B's rows exactly as the weight
is split: B's TP shards go through `megagrpo.hf.io.unfuse_shards` with the weight's ParamSpec
(B [out, r] has the weight's rows). Row-parallel layers (o_proj, down_proj): A's TP shards are
the weight's column split, joined by the same function; B is replicated.
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.distributed as dist

from megagrpo.config.lora import LoRAConfig
from megagrpo.config.model import ModelConfig, ParallelConfig
from megagrpo.config.params import param_specs
from megagrpo.hf.io import unfuse_shards
from megagrpo.lora.layers import adapters_disabled, parameters_for_refit
from megagrpo.model.gpt import unwrap

PEFT_PREFIX = "base_model.model."
"""What peft puts before the transformers module name in adapter_model.safetensors."""
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def _tp_shards(t: torch.Tensor, split: bool) -> list[torch.Tensor]:
    """Every TP rank's shard of `t` (rank order) when it is split over TP, else [t]."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    if not split or dist.get_world_size(group) == 1:
        return [t]
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def _stage_adapters(gpt: torch.nn.Module, model: ModelConfig, parallel: ParallelConfig
                    ) -> dict[str, torch.Tensor]:
    """{peft tensor name: full CPU tensor} of this pipeline stage's adapters (collective over
    the TP group: every TP rank of the stage gets the same dict)."""
    from megatron.core import parallel_state as ps

    impl = "transformer_engine" if any("layer_norm_weight" in n for n, _ in
                                       gpt.named_parameters()) else "local"
    specs = {s.local: s for s in param_specs(model, parallel,
                                             ps.get_pipeline_model_parallel_rank(), impl,
                                             ep_rank=ps.get_expert_model_parallel_rank())}
    out: dict[str, torch.Tensor] = {}
    for name, m in gpt.named_modules():
        if not hasattr(m, "lora_B"):
            continue
        spec = specs[f"{name}.weight"]
        a, b = m.lora_A.detach(), m.lora_B.detach()
        if m.lora_row:  # A [r, in/tp] split like W's columns, B [out, r] replicated
            parts = [(hf, a_full, b) for hf, a_full in unfuse_shards(_tp_shards(a, True), spec,
                                                                     model)]
        else:  # A [r, in] replicated, B [out/tp, r] has W's rows (fused QKV / gate-up)
            parts = [(hf, a, b_part) for hf, b_part in unfuse_shards(_tp_shards(b, True), spec,
                                                                     model)]
        for hf, a_part, b_part in parts:
            module = PEFT_PREFIX + hf.removesuffix(".weight")
            # own copies: safetensors refuses tensors sharing memory (A repeats per part)
            out[f"{module}.lora_A.weight"] = a_part.cpu().clone().contiguous()
            out[f"{module}.lora_B.weight"] = b_part.cpu().clone().contiguous()
    return out


def gather_adapters(gpt: torch.nn.Module, model: ModelConfig, parallel: ParallelConfig
                    ) -> dict[str, torch.Tensor]:
    """Every adapter of the model in peft's names and per-projection layout, on every rank of
    the model-parallel group (collective over TP, EP and PP; a few MB, moved as objects).
    Expert adapters are named as peft names them on the HF model's per-expert modules
    (`mlp.experts.N.gate_proj`, `mlp.shared_expert.down_proj`): gathered from every EP rank."""
    from megatron.core import parallel_state as ps

    mine = _stage_adapters(unwrap(gpt), model, parallel)
    if parallel.ep > 1:  # each EP rank holds its own experts' adapters
        ranks: list = [None] * parallel.ep
        dist.all_gather_object(ranks, mine, group=ps.get_expert_model_parallel_group())
        mine = {k: v for r in ranks for k, v in r.items()}
    if parallel.pp == 1:
        return mine
    stages: list = [None] * parallel.pp
    dist.all_gather_object(stages, mine, group=ps.get_pipeline_model_parallel_group())
    return {k: v for s in stages for k, v in s.items()}


def adapter_config(cfg: LoRAConfig, base: str, names: Iterable[str]) -> dict:
    """peft's adapter_config.json for the adapter tensors `names` (the keys peft reads; the
    rest default): target_modules are the HF projections the tensors sit beside."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
            "r": cfg.rank, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout,
            "target_modules": sorted({n.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for n in names}),
            "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "inference_mode": True, "init_lora_weights": True, "modules_to_save": None}


def save_peft_adapter(out_dir: str | os.PathLike, tensors: dict[str, torch.Tensor],
                      cfg: LoRAConfig, base: str) -> Path:
    """Writes the adapter folder (renamed into place at the end). Returns it."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(dict(sorted(tensors.items())), str(tmp / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(cfg, base, tensors), indent=2))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def export_base_and_adapter(gpt: torch.nn.Module, hf_dir: str, adapter_dir: str,
                            model: ModelConfig, parallel: ParallelConfig, cfg: LoRAConfig,
                            export_hf: Callable) -> int:
    """The base (adapters off: W as held) as an HF folder, written by `export_hf`
    (`megagrpo.sync.source.export_hf`), and the adapters as a peft folder beside it. Every rank
    of the model-parallel group calls this; global rank 0 writes. Returns the adapter tensors'
    bytes."""
    with adapters_disabled(gpt):  # the merged view reads W, not W + s B A
        export_hf(gpt, hf_dir, model, parallel, params=parameters_for_refit(gpt))
    tensors = gather_adapters(gpt, model, parallel)
    if not dist.is_initialized() or dist.get_rank() == 0:
        save_peft_adapter(adapter_dir, tensors, cfg, str(Path(hf_dir).resolve()))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def export_checkpoint(gpt: torch.nn.Module, ckpt: str, hf_dir: str, model: ModelConfig,
                      parallel: ParallelConfig, export_hf: Callable, *,
                      adapter_dir: str | None = None, loud: bool = False) -> None:
    """`convert --from-megatron CKPT --to-hf DIR` on this rank's stage `gpt`: a LoRA run's
    checkpoint gets its adapters before loading (else they would not be read), then exports
    merged, or with `adapter_dir` as the base unmerged plus a peft adapter there; a full-parameter
    checkpoint exports as it is. `loud`: print what was done (rank 0)."""
    from megagrpo.checkpoint import load_model
    from megagrpo.lora.checkpoint import checkpoint_lora
    from megagrpo.lora.layers import add_adapters

    lora = checkpoint_lora(ckpt)
    if lora is not None:
        add_adapters(gpt, lora, seed=0)
    load_model(gpt, ckpt)
    what = f"rank {lora.rank} on {','.join(lora.targets)}" if lora is not None else ""
    if adapter_dir:
        nbytes = export_base_and_adapter(gpt, hf_dir, adapter_dir, model, parallel, lora,
                                         export_hf)
        if loud:
            print(f"lora: {hf_dir} holds the checkpoint's base weights (adapters not merged); "
                  f"the peft adapter ({what}, {nbytes:,} bytes) is in {adapter_dir}")
        return
    export_hf(gpt, hf_dir, model, parallel,
              params=parameters_for_refit(gpt))  # adapted weights export merged
    if lora is not None and loud:
        print(f"lora: the checkpoint's adapters ({what}) are merged into the export")
