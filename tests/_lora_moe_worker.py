"""The MoE part of tests/_lora_worker.py's launch (2 ranks, gloo): the parent's tiny Qwen2-MoE
(routed experts, a gated shared expert, a dense layer) at EP=2 (dense DP=2, each rank its own
row of the batch), LoRA on qkv, proj, fc1, fc2 (every expert, the shared expert, the dense
MLP). One forward/backward through megatron's schedule and DDP; every adapter's values and
reduced gradients saved as full tensors under HF projection names (WORK/moe_ep2_rank<r>.pt);
then the merge checks, a checkpoint (with the merged export and the peft export beside it), and
the checkpoint loaded at EP=1 (WORK/moe_ep1_loaded_rank<r>.pt, and the peft export there)."""
import dataclasses
import os
import zlib

import torch
import torch.distributed as dist

from tests.support.megatron import backward_rows, ddp_and_optimizer

MOE = "qwen2_moe"
LORA = dict(rank=4, alpha=8.0)


def expert_adapter_tensors(gpt, mcfg, parallel, grads: bool):
    """{HF projection: {"A": [r, in], "B": [out, r]}} of this rank's adapters at TP=1 (its own
    experts under their global names): values, or DDP's reduced main grads; fc1's A under both
    gate_proj and up_proj, its B split into the two."""
    from megatron.core import parallel_state as ps

    from megagrpo.config.params import param_specs
    from megagrpo.hf.io import unfuse_shards

    specs = {s.local: s for s in param_specs(mcfg, parallel, 0,
                                             ep_rank=ps.get_expert_model_parallel_rank())}
    out = {}
    for name, m in gpt.named_modules():
        if not hasattr(m, "lora_B"):
            continue
        a, b = (m.lora_A.main_grad, m.lora_B.main_grad) if grads else (m.lora_A, m.lora_B)
        a, b = a.detach().double(), b.detach().double()
        spec = specs[name + ".weight"]
        if m.lora_row:
            out[spec.hf[0].removesuffix(".weight")] = {"A": a, "B": b}
            continue
        for hf_name, part in unfuse_shards([b], spec, mcfg):
            out[hf_name.removesuffix(".weight")] = {"A": a, "B": part.clone()}
    return out


def randomize_b_by_name(gpt, mcfg, parallel, seed: int) -> None:
    """Seeded random B on every adapter from its global (HF) name: a replicated adapter gets
    the same values on every rank, each expert its own."""
    from megatron.core import parallel_state as ps

    from megagrpo.config.params import param_specs

    specs = {s.local: s for s in param_specs(mcfg, parallel, 0,
                                             ep_rank=ps.get_expert_model_parallel_rank())}
    with torch.no_grad():
        for name, m in gpt.named_modules():
            if hasattr(m, "lora_B"):
                key = zlib.crc32(specs[name + ".weight"].hf[0].encode())
                g = torch.Generator().manual_seed(seed * 7919 + key)
                m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.05)


def build(work, ep, tp=1, targets=None):
    from megagrpo.config.lora import LoRAConfig
    from megagrpo.config.model import ParallelConfig
    from megagrpo.hf import load_hf_weights, model_config_from_hf
    from megagrpo.lora.layers import add_adapters
    from megagrpo.model.gpt import build_model
    from megagrpo.runtime.distributed import init_distributed

    # no load-balancing loss: the parent's reference is the plain cross-entropy
    mcfg = dataclasses.replace(model_config_from_hf(os.path.join(work, MOE)),
                               moe_aux_loss_coef=0.0)
    parallel = ParallelConfig(ep=ep, tp=tp, sequence_parallel=tp > 1,
                              make_vocab_size_divisible_by=64)
    lcfg = LoRAConfig(**LORA, **({"targets": targets} if targets else {}))
    lcfg.validate(mcfg, parallel)
    info = init_distributed(parallel, mcfg)
    gpt = build_model(mcfg, parallel, seed=7)
    load_hf_weights(gpt, os.path.join(work, MOE), mcfg, parallel, tp_rank=info.tp_rank,
                    pp_rank=info.pp_rank)
    n = add_adapters(gpt, lcfg, seed=3)
    return gpt, mcfg, parallel, lcfg, info, n


def run_moe(work, results, ce_step, merge_checks):
    """EP=2: gradients, base frozen, optimizer contents, merge checks, checkpoint + exports."""
    from megagrpo.checkpoint import save_model
    from megagrpo.lora.export import export_base_and_adapter
    from megagrpo.lora.layers import parameters_for_refit
    from megagrpo.model.optim import OptimConfig, adam_footprint, optimizer_step
    from megagrpo.sync.source import export_hf

    ref = torch.load(os.path.join(work, "ref_moe.pt"))
    gpt, mcfg, parallel, lcfg, info, n_adapter = build(work, ep=2)
    randomize_b_by_name(gpt, mcfg, parallel, seed=5)
    values = expert_adapter_tensors(gpt, mcfg, parallel, grads=False)
    ddp, opt = ddp_and_optimizer(gpt, OptimConfig(lr=1e-3, clip_grad=0.0))
    r = dist.get_rank()  # each DP rank its own row: the experts get both through the all-to-all
    backward_rows(ddp, ce_step(mcfg), ref["ids"][r:r + 1], ref["labels"][r:r + 1])
    grads = expert_adapter_tensors(gpt, mcfg, parallel, grads=True)
    base_grad = [n for n, p in gpt.named_parameters() if ".lora_" not in n and (
        p.requires_grad or p.grad is not None or getattr(p, "main_grad", None) is not None)]
    ok, _ = optimizer_step(ddp, opt)
    opt_numel, _ = adam_footprint(opt)
    torch.save({"values": values, "grads": grads}, os.path.join(work, f"moe_ep2_rank{r}.pt"))
    results.append({"tag": "moe_ep2", "rank": r, "adapter_numel": n_adapter,
                    "planned_numel": lcfg.rank_numel(mcfg, 1, mcfg.num_layers, ep=2),
                    "opt_numel": opt_numel, "base_with_grad": base_grad, "step_ok": ok})
    merge_checks(ddp, mcfg, parallel, ref["ids"], results, check="merge_moe")
    save_model(ddp, os.path.join(work, "ckpt_moe"), mcfg, extra={"lora": LORA})
    export_hf(ddp, os.path.join(work, "export_moe"), mcfg, parallel,
              params=parameters_for_refit(ddp))  # merged
    export_base_and_adapter(ddp, os.path.join(work, "base_moe"), os.path.join(work, "peft_moe"),
                            mcfg, parallel, lcfg, export_hf)
    torch.save(expert_adapter_tensors(gpt, mcfg, parallel, grads=False),
               os.path.join(work, f"moe_saved_rank{r}.pt"))
    dist.barrier()


def load_moe_ep1(work):
    """The EP=2 checkpoint loaded at EP=1 (each rank every expert): adapter values, and the
    peft export from this layout."""
    from megagrpo.checkpoint import load_model
    from megagrpo.lora.export import export_base_and_adapter
    from megagrpo.sync.source import export_hf

    gpt, mcfg, parallel, lcfg, _, _ = build(work, ep=1)
    load_model(gpt, os.path.join(work, "ckpt_moe"))
    torch.save(expert_adapter_tensors(gpt, mcfg, parallel, grads=False),
               os.path.join(work, f"moe_ep1_loaded_rank{dist.get_rank()}.pt"))
    export_base_and_adapter(gpt, os.path.join(work, "base_moe_ep1"),
                            os.path.join(work, "peft_moe_ep1"), mcfg, parallel, lcfg, export_hf)
    dist.barrier()


def run_moe_tp2_sp(work, results, ce_step, adapter_tensors):
    """TP=2 with sequence parallelism (megagrpo's default for an MoE at tp > 1), attention
    adapters (qkv, proj), both rows on both ranks: the adapters' reduced gradients as full
    tensors (WORK/moe_tp2_sp_rank<r>.pt) for the parent's float64 reference, and the step."""
    from megagrpo.model.optim import OptimConfig, optimizer_step

    ref = torch.load(os.path.join(work, "ref_moe.pt"))
    gpt, mcfg, parallel, _, _, _ = build(work, ep=1, tp=2, targets=["qkv", "proj"])
    randomize_b_by_name(gpt, mcfg, parallel, seed=5)
    values = adapter_tensors(gpt, mcfg, parallel, grads=False)
    ddp, opt = ddp_and_optimizer(gpt, OptimConfig(lr=1e-3, clip_grad=0.0))
    backward_rows(ddp, ce_step(mcfg), ref["ids"][:2], ref["labels"][:2])
    grads = adapter_tensors(gpt, mcfg, parallel, grads=True)
    ok, _ = optimizer_step(ddp, opt)
    torch.save({"values": values, "grads": grads},
               os.path.join(work, f"moe_tp2_sp_rank{dist.get_rank()}.pt"))
    results.append({"tag": "moe_tp2_sp", "rank": dist.get_rank(), "step_ok": ok,
                    "sequence_parallel": bool(gpt.config.sequence_parallel)})
    dist.barrier()
