"""Run on local ranks (2 processes, gloo) by tests/test_lora.py. One launch covers the layouts
TP=2 (with and without sequence parallelism), PP=2 and DP=2 (plain and distributed
optimizer): the parent's tiny Llama is loaded, adapters
added (B set to seeded random values so that A's gradient is not zero), one forward/backward of
a token-mean cross-entropy runs through megatron's schedule and DDP, and each adapter's values
and reduced gradients are saved as full tensors under HF projection names (WORK/<tag>_rank<r>.pt)
for the parent's float64 transformers reference. At TP=2 the merge (reference reset) is checked,
then checkpoints are written by megagrpo's CheckpointManager over a LoRA policy's parts (the base
only after a merge, megagrpo.lora.checkpoint; their bytes measured) and loaded at PP=2 (the
adapters and the base reshard; a checkpoint of the older one-folder format too); at both layouts
the base and a peft adapter are exported (megagrpo.lora.export). Then the MoE checks
(tests/_lora_moe_worker.py: expert adapters at EP=2, reloaded at EP=1). Scalars go to
WORK/results.json."""
import os

import torch
import torch.distributed as dist

from tests._lora_moe_worker import load_moe_ep1, run_moe, run_moe_tp2_sp
from tests.support.launch import worker_args, write_results
from tests.support.megatron import backward_rows, ddp_and_optimizer

LABEL_SEED = 11


def vocab_logits(gpt, mcfg, ids):
    """[B, S, V] full-vocab logits of the last stage (autograd through the TP gather)."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    pos = torch.arange(ids.shape[1]).expand_as(ids)
    local = gpt(ids, pos, None)
    return local, lambda o: gather_from_tensor_model_parallel_region(o)[..., :mcfg.vocab_size]


def ce_step(mcfg):
    def fwd(batch, model):
        ids, labels = batch
        out, full = vocab_logits(model, mcfg, ids)

        def loss_fn(o):
            logits = full(o).float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     labels.reshape(-1))
            return loss, {"logits": logits.detach()}

        return out, loss_fn

    return fwd


def gather(t, dim, group):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def adapter_tensors(gpt, mcfg, parallel, grads: bool):
    """{HF projection: {"A": [r, in], "B": [out, r]}} of this stage's adapters, full tensors
    (values, or DDP's reduced main grads); a fused layer's A is stored under each of its
    parts' names, its B split into the parts."""
    from megatron.core import parallel_state as ps

    from megagrpo.config.params import layer_specs
    from megagrpo.hf.io import unfuse_shards

    tp_group = ps.get_tensor_model_parallel_group()
    out = {}
    for layer in gpt.decoder.layers:
        g = layer.layer_number - 1
        specs = {s.local.split(".", 3)[-1]: s for s in layer_specs(mcfg, g, 0)}
        for name in ("self_attention.linear_qkv", "self_attention.linear_proj",
                     "mlp.linear_fc1", "mlp.linear_fc2"):
            m = getattr(layer.get_submodule(name.split(".")[0]), name.split(".")[1], None)
            if not hasattr(m, "lora_B"):  # an MoE layer's mlp; an untargeted linear
                continue
            a, b = (m.lora_A.main_grad, m.lora_B.main_grad) if grads else (m.lora_A, m.lora_B)
            a, b = a.detach().double(), b.detach().double()
            spec = specs[name + ".weight"]
            if m.lora_row:
                full_a = torch.cat(gather(a, 1, tp_group), dim=1)
                out[spec.hf[0].removesuffix(".weight")] = {"A": full_a, "B": b}
                continue
            parts = unfuse_shards(gather(b, 0, tp_group), spec, mcfg)
            for hf_name, part in parts:
                out[hf_name.removesuffix(".weight")] = {"A": a, "B": part.clone()}
    return out


def randomize_b(gpt, seed: int) -> None:
    """Seeded random B on every adapter, the same full tensor on every rank (each keeps its
    own TP slice), so A's gradient is not zero."""
    from megatron.core import parallel_state as ps

    tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    from megagrpo.lora.layers import adapted

    with torch.no_grad():
        for i, m in enumerate(adapted(gpt)):
            gen = torch.Generator().manual_seed(seed * 1000 + m.lora_B.shape[0] + i)
            rows = m.lora_B.shape[0] * (1 if m.lora_row else tp)
            full = torch.randn(rows, m.lora_B.shape[1], generator=gen) * 0.05
            n = m.lora_B.shape[0]
            m.lora_B.copy_(full if m.lora_row else full[r * n:(r + 1) * n])


def run_layout(tag, tp, pp, dist_opt, work, results, load_from=None, sp=False):
    from megatron.core import parallel_state as ps

    from megagrpo.config.lora import LoRAConfig
    from megagrpo.config.model import ParallelConfig
    from megagrpo.hf import load_hf_weights, model_config_from_hf
    from megagrpo.lora.layers import add_adapters
    from megagrpo.model.gpt import build_model
    from megagrpo.model.optim import OptimConfig, adam_footprint, optimizer_step
    from megagrpo.runtime.distributed import init_distributed

    ref = torch.load(os.path.join(work, "ref.pt"))
    mcfg = model_config_from_hf(os.path.join(work, "llama"))
    parallel = ParallelConfig(tp=tp, pp=pp, make_vocab_size_divisible_by=64,
                              sequence_parallel=sp)
    info = init_distributed(parallel, mcfg)
    gpt = build_model(mcfg, parallel, seed=7)
    load_hf_weights(gpt, os.path.join(work, "llama"), mcfg, parallel, tp_rank=info.tp_rank,
                    pp_rank=info.pp_rank)
    lcfg = LoRAConfig(rank=4, alpha=8.0)
    n_adapter = add_adapters(gpt, lcfg, seed=3)
    if load_from:  # a checkpoint of another layout: the adapters reshard like their weights
        load_checks(gpt, mcfg, load_from, results)
        torch.save(adapter_tensors(gpt, mcfg, parallel, grads=False),
                   os.path.join(work, f"{tag}_rank{dist.get_rank()}.pt"))
        from megagrpo.lora.export import export_base_and_adapter
        from megagrpo.sync.source import export_hf

        export_base_and_adapter(gpt, os.path.join(work, "base_pp2"),
                                os.path.join(work, "peft_pp2"), mcfg, parallel, lcfg,
                                export_hf)
        return None, None, mcfg, parallel
    randomize_b(gpt, seed=5)
    values = adapter_tensors(gpt, mcfg, parallel, grads=False)
    ddp, opt = ddp_and_optimizer(gpt, OptimConfig(lr=1e-3, clip_grad=0.0,
                                                  distributed_optimizer=dist_opt))
    # each DP rank its own rows (equal lengths: the mean over DP of the ranks' token means is
    # the whole batch's), so the gradients equal the reference only through DDP's all-reduce
    ids, labels = (t.chunk(info.dp)[info.dp_rank] for t in (ref["ids"], ref["labels"]))
    backward_rows(ddp, ce_step(mcfg), ids, labels)
    grads = adapter_tensors(gpt, mcfg, parallel, grads=True)
    base = [(n, p) for n, p in gpt.named_parameters() if ".lora_" not in n]
    base_grad = [n for n, p in base if p.requires_grad or p.grad is not None
                 or getattr(p, "main_grad", None) is not None]
    ok, _ = optimizer_step(ddp, opt)
    opt_numel, state_bytes = adam_footprint(opt)
    torch.save({"values": values, "grads": grads},
               os.path.join(work, f"{tag}_rank{dist.get_rank()}.pt"))
    results.append({"tag": tag, "rank": dist.get_rank(), "dp_rank": info.dp_rank,
                    "adapter_numel": n_adapter, "opt_numel": opt_numel,
                    "opt_state_bytes": state_bytes, "base_with_grad": base_grad,
                    "step_ok": ok, "last_stage": ps.is_pipeline_last_stage(),
                    **moment_scaling_checks(gpt, opt)})
    return ddp, opt, mcfg, parallel


def _megatron_moments(opt, p: torch.nn.Parameter) -> list[dict]:
    """Adam's state of model parameter `p` as megatron's optimizers hold it, read through
    megatron's own accessors (the distributed optimizer's `_get_main_param_and_optimizer_states`,
    the float16 one's `main_param`, the fp32 one's parameter)."""
    out = []
    for o in getattr(opt, "chained_optimizers", [opt]):
        if hasattr(o, "model_param_group_index_map"):
            if p in o.model_param_group_index_map:
                out.append(o._get_main_param_and_optimizer_states(p))
        else:
            main = getattr(p, "main_param", None)
            state = o.optimizer.state.get(p if main is None else main)
            if state:
                out.append(state)
    return out


def moment_scaling_checks(gpt, opt) -> dict:
    """`scale_adam_moments` on megatron's real optimizer (after one step): every A's moments
    halved / quartered, every B's untouched, then restored exactly (powers of two)."""
    from megagrpo.lora.layers import adapted
    from megagrpo.model.optim import scale_adam_moments

    mods = adapted(gpt)
    params = [(m.lora_A, 0.5) for m in mods] + [(m.lora_B, 1.0) for m in mods]
    before = [[(s["exp_avg"].clone(), s["exp_avg_sq"].clone()) for s in _megatron_moments(opt, p)]
              for p, _ in params]
    half = {m.lora_A: torch.full((m.lora_A.shape[0], 1), 0.5, dtype=torch.float64) for m in mods}
    scaled = scale_adam_moments(opt, half)
    ok = all(torch.equal(s["exp_avg"], m0 * c) and torch.equal(s["exp_avg_sq"], v0 * c * c)
             for (p, c), saved in zip(params, before)
             for (m0, v0), s in zip(saved, _megatron_moments(opt, p)))
    scale_adam_moments(opt, {a: torch.full_like(c, 2.0) for a, c in half.items()})
    return {"moments_found": sum(len(b) for b in before[:len(mods)]), "moments_scaled": scaled,
            "moments_ok": ok}


class Merges:
    """The merge count as a replicated checkpoint part (a run keeps it in LoRAReference)."""

    def __init__(self):
        self.n = 0

    def state_dict(self) -> dict:
        return {"merges": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["merges"]


def _listing(root) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if dist.get_rank() == 0 else []


def _payload(folder) -> int:
    """Bytes of the tensors a dist-checkpoint holds (each once, from its metadata)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    return sum(m.size.numel() * m.properties.dtype.itemsize for m in meta.values()
               if isinstance(m, TensorStorageMetadata))


def checkpoint_checks(ddp, opt, mcfg, work, results) -> None:
    """megagrpo's CheckpointManager over a LoRA policy's parts (keep_last=2): checkpoint 1
    writes the base, a merge (alpha 0.5: B stays non-zero), checkpoint 2 writes it again, 3
    names 2's; the bytes of each; and the older one-folder format (base and adapters in
    policy/) of the same state as 3, for the loader."""
    from megagrpo.checkpoint import CheckpointManager, ModelState, OptimizerState, Replicated, _Pair
    from megagrpo.lora.checkpoint import lora_parts
    from megagrpo.lora.layers import merge_adapters
    from megagrpo.runtime.run_dir import manifest_bytes

    merges = Merges()
    lora = {"lora": {"rank": 4, "alpha": 8.0}}
    states = {**lora_parts(ddp, mcfg, lambda: merges.n, extra=lora),
              "optimizer": OptimizerState(_Pair(ddp, opt)), "count": Replicated(merges)}
    mgr = CheckpointManager(os.path.join(work, "run_tp2"), 2, states, layout={"tp": 2})
    mgr.save(1)
    after = {1: _listing(mgr.root)}
    merge_adapters(ddp, alpha=0.5)
    merges.n += 1
    for step in (2, 3):
        mgr.save(step)
        after[step] = _listing(mgr.root)
    old = {"policy": ModelState(ddp, mcfg, extra=lora), "count": Replicated(merges)}
    CheckpointManager(os.path.join(work, "old_tp2"), 2, old, layout={"tp": 2}).save(3)
    if dist.get_rank() == 0:
        root, step = mgr.root, mgr.path
        results.append({
            "check": "checkpoints", "after": {str(k): v for k, v in after.items()},
            "bytes": {f: manifest_bytes(root / f) for f in
                      ("step_000002", "step_000003", "base_000001")},
            "payload": {f: _payload(root / f) for f in
                        ("step_000002/policy", "step_000002/optimizer", "step_000003/policy",
                         "step_000003/optimizer", "base_000001")},
            "files_3": sorted(str(p.relative_to(step(3))) for p in step(3).rglob("*")
                              if p.is_file())})


def load_checks(gpt, mcfg, work, results) -> None:
    """At PP=2: the one-folder checkpoint loaded by a manager over the LoRA parts (its adapters
    recorded, the base then written anew), then the run's newest checkpoint (3, no base of its
    own: 2's), and a checkpoint 4 from here (the base not written again)."""
    from megagrpo.checkpoint import CheckpointManager, Replicated
    from megagrpo.lora.checkpoint import lora_parts

    merges = Merges()
    parts = lora_parts(gpt, mcfg, lambda: merges.n, extra={"lora": {"rank": 4, "alpha": 8.0}})
    res = {"check": "loaded"}
    for name in ("old_tp2", "run_tp2"):
        mgr = CheckpointManager(os.path.join(work, name), 2,
                                {**parts, "count": Replicated(merges)}, layout={"pp": 2})
        ckpt = mgr.latest()
        mgr.load(ckpt)
        res[name] = {"step": ckpt.name, "written": parts["base"].written, "merges": merges.n}
        if name == "old_tp2":
            torch.save(adapter_tensors(gpt, mcfg, None, grads=False),
                       os.path.join(work, f"old_pp2_rank{dist.get_rank()}.pt"))
            mgr.save(4)  # the base goes to a folder of its own now
            res[name]["after_save"] = _listing(mgr.root)
    mgr.save(4)
    res["run_tp2"]["after_save"] = _listing(mgr.root)
    if dist.get_rank() == 0:
        results.append(res)


def merge_checks(ddp, mcfg, parallel, ids, results, check="merge"):
    """At the current layout: policy logits before and after a merge (alpha 1), the reference's
    (adapters off) after it, the KL estimate between them, and the alpha-mix identity in weight
    space (base' = base + a s B A, policy weights unchanged)."""
    from megagrpo.config.train import ReferenceConfig
    from megagrpo.lora.layers import LoRAReference, MergedParams, adapted, merge_adapters
    from megagrpo.model.gpt import unwrap
    from megagrpo.runtime.cpu_compat import megatron_scope

    gpt = unwrap(ddp)
    fwd = vocab_logits

    def logits():
        with torch.no_grad(), megatron_scope():
            out, full = fwd(gpt, mcfg, ids)
            return full(out)

    refr = LoRAReference(ddp, ReferenceConfig(alpha=1.0))
    randomize_b(gpt, seed=9)
    before = logits()
    equal_before = refr.equals(ddp)
    refr.sync(ddp, step=1, epoch=0, version=0)
    after = logits()
    refr.onload()
    ref_logits = logits()
    refr.offload()
    lp, lr = torch.log_softmax(after.double(), -1), torch.log_softmax(ref_logits.double(), -1)
    kl = (torch.exp(lr - lp) - (lr - lp) - 1).abs().max().item()  # k3 estimator per token
    res = {"check": check, "policy_change": (after - before).abs().max().item(),
           "policy_scale": before.abs().max().item(),
           "ref_equals_policy": bool(torch.equal(after, ref_logits)), "kl_max": kl,
           "equals_before": equal_before, "equals_after": refr.equals(ddp)}
    # alpha-mix, in weight space, per shard
    randomize_b(gpt, seed=13)
    a = 0.3
    mods = adapted(gpt)
    w0 = [m.weight.detach().clone().double() for m in mods]
    merged0 = MergedParams(gpt)
    names = [n for n in merged0._adapted]
    policy0 = [merged0[n].double().clone() for n in names]
    deltas = [(m.lora_B.double() @ m.lora_A.double()) * m.lora_scale for m in mods]
    merge_adapters(ddp, alpha=a)
    merged1 = MergedParams(gpt)
    ref_err = max(((m.weight.double() - (w + a * d)).abs().max() / (w + a * d).abs().max()).item()
                  for m, w, d in zip(mods, w0, deltas))
    # the reference moves to a * policy + (1 - a) * ref
    mix_err = max(((m.weight.double() - (a * p + (1 - a) * w)).abs().max()
                   / p.abs().max()).item() for m, w, p in zip(mods, w0, policy0))
    pol_err = max(((merged1[n].double() - p).abs().max() / p.abs().max()).item()
                  for n, p in zip(names, policy0))
    res.update(mix_ref_rel_err=ref_err, mix_identity_rel_err=mix_err,
               mix_policy_rel_err=pol_err)
    results.append(res)


def main():
    from megagrpo.config.lora import LoRAConfig
    from megagrpo.lora.export import export_base_and_adapter
    from megagrpo.lora.layers import parameters_for_refit
    from megagrpo.sync.source import export_hf

    args = worker_args()
    results = []
    ref = torch.load(os.path.join(args.work, "ref.pt"))
    # the distributed optimizer reduce-scatters: each DP rank's main grads are reduced in its
    # own shard only, so its layout checks the optimizer's contents, not the gradients
    for tag, tp, pp, dist_opt in (("tp2", 2, 1, False), ("tp2_sp", 2, 1, False),
                                  ("pp2", 1, 2, False), ("dp2", 1, 1, False),
                                  ("dp2_distopt", 1, 1, True), ("pp2_loaded", 1, 2, False)):
        ddp, opt, mcfg, parallel = run_layout(
            tag, tp, pp, dist_opt, args.work, results,
            load_from=args.work if tag == "pp2_loaded" else None, sp=tag == "tp2_sp")
        if tag == "tp2_sp":  # the merge under sequence parallelism
            merge_checks(ddp, mcfg, parallel, ref["ids"], results, check="merge_sp")
        if tag == "tp2":
            merge_checks(ddp, mcfg, parallel, ref["ids"], results)
            checkpoint_checks(ddp, opt, mcfg, args.work, results)  # the state saved from here on
            export_hf(ddp, os.path.join(args.work, "export_tp2"), mcfg, parallel,
                      params=parameters_for_refit(ddp))  # merged
            # the base as held (after the merge checks: a merged base, B not zero) and the
            # adapters in peft's layout, gathered over TP=2
            export_base_and_adapter(ddp, os.path.join(args.work, "base_tp2"),
                                    os.path.join(args.work, "peft_tp2"), mcfg, parallel,
                                    LoRAConfig(rank=4, alpha=8.0), export_hf)
            torch.save(adapter_tensors(ddp.module, mcfg, parallel, grads=False),
                       os.path.join(args.work, f"saved_rank{dist.get_rank()}.pt"))
        dist.barrier()
    # MoE: expert adapters at EP=2 (gradients, merge, checkpoint), reloaded at EP=1
    run_moe(args.work, results, ce_step, merge_checks)
    run_moe_tp2_sp(args.work, results, ce_step, adapter_tensors)
    load_moe_ep1(args.work)
    write_results(results, args.work, flat=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
