"""Run on local ranks (4 ranks, gloo) by tests/test_context_parallel.py: context parallelism
(parallel.cp) against the same passes without it, in one launch.

Layouts (name: tp, cp; DP = 4 / (tp x cp)), each DP replica training on its own slice of one
global batch of 8 rows, so every layout's reduced gradients are the whole batch's:
ref (TP=1 x DP=4, no CP), cp2 (CP=2 x DP=2), tp2 (TP=2 x DP=2), tp2_cp2 (TP=2 x CP=2).
Per layout and rank: the scoring pass's log-probs of the whole batch, and the finalized
gradients (main_grad) of the update passes below with their summed loss reports, and the
optimizer's grad norm of GRPO's gradients. At cp2 the
same passes rerun with a defect planted (keys visible beyond the causal mask; the sequence-mean
denominators of the chunk instead of the whole row), which must change the gradients. At
cp2 and tp2_cp2 GRPO, GSPO and DAPO (fused) also run on packed micro-batches (PACKED_RUNS:
each row cut into its own 2 x cp chunks), with the scoring pass, and at cp2 GRPO once more with
packed rows attending across their boundaries (the defect PACKED_DEFECT).
Rank 0 writes WORK/results.json; the gradients go to WORK/grads_{layout}_{rank}.pt."""
import dataclasses
import os
from functools import partial

import torch
import torch.distributed as dist

from tests._fused_output_worker import grads, make_batch, make_config
from tests.support.launch import worker_args, write_results
from tests.support.megatron import ddp_and_optimizer

LAYOUTS = {"ref": (1, 1), "cp2": (1, 2), "tp2": (2, 1), "tp2_cp2": (2, 2)}
RUNS = {  # name: (loss, loss_agg, logits at loss positions, fused output layer)
    "grpo_logits": ("grpo", "grpo", True, False),
    "grpo_all_positions": ("grpo", "grpo", False, False),
    "gspo_logits": ("grpo", "gspo", True, False),  # the sequence ratio summed over CP
    "dapo_fused": ("grpo", "dapo", True, True),
    "dr_grpo_fused": ("grpo", "dr_grpo", True, True),
    "sft_fused": ("sft", "grpo", True, True),
}
DEFECTS = ("full_mask", "chunk_denominators")
PACKED_RUNS = ("grpo_logits", "gspo_logits", "dapo_fused")  # compute.pack_sequences at CP
PACKED_DEFECT = "packed_across_rows"


def global_batch():
    """8 rows of varied widths with independent old and reference log-probs."""
    batch = make_batch(3, 1)
    g = torch.Generator().manual_seed(5)
    batch.old_logp = torch.where(batch.mask, -4.6 + 0.3 * torch.randn(batch.mask.shape,
                                                                        generator=g), 0.0)
    batch.ref_logp = torch.where(batch.mask, -4.6 + 0.5 * torch.randn(batch.mask.shape,
                                                                        generator=g), 0.0)
    return batch


def run_passes(passes, ddp, opt, batch, cfg, runs) -> dict:
    """{run: (gradient list, report)} for `runs` over this replica's `batch`."""
    from megagrpo.train.losses import grpo_loss, sft_loss

    fns = {"grpo": grpo_loss, "sft": sft_loss}
    out = {}
    for key in runs:
        fn, agg, at_loss, fused = RUNS[key]
        cfg.algo.loss_agg, cfg.compute.logits_at_loss_positions = agg, at_loss
        cfg.compute.fused_output_layer = fused
        out[key] = grads(passes, ddp, opt, fns[fn], batch, cfg.compute.micro_batch_size,
                         cfg.algo)
    return out


def plant(defect: str):
    """Undo-able monkeypatches of megagrpo.parallel.context_parallel for one defect: [(module, attr,
    replacement)]."""
    import megagrpo.parallel.context_parallel as cp

    if defect == "full_mask":  # every key visible: the diagonal block's causal mask dropped
        flash, flash_backward = cp._flash, cp._flash_backward

        class _Ops:
            @staticmethod
            def forward(q, k, v, dropout_p, is_causal, **kw):
                return flash(q, k, v, dropout_p, False, **kw)

            @staticmethod
            def backward(*args, **kw):
                return flash_backward(*args[:7], False, **kw)

        return [(cp, "_flash", _Ops.forward), (cp, "_flash_backward", _Ops.backward)]
    if defect == PACKED_DEFECT:  # packed rows: causal over the whole stream, rows ignored
        return [(cp, "cp_packed_attention", _across_rows)]
    local = cp.local_batch  # the chunk's own token counts as sequence lengths

    def chunk_only(*args):
        return dataclasses.replace(local(*args), seq_tokens=None)

    return [(cp, "local_batch", chunk_only)]


def _across_rows(query, key, value, rows, *, group, scale):
    """The packing defect: this rank's packed queries attend to every key of the gathered
    stream (rows end to end, `rows.kv_order`) up to their own place in it, the keys of the
    rows before theirs included (an explicit mask, SDPA)."""
    import megagrpo.parallel.context_parallel as cp

    k, v = (cp.gather_sequence(t, group).index_select(0, rows.kv_order) for t in (key, value))
    T, rank = query.shape[0], dist.get_rank(group)
    place = rows.kv_order.argsort()[rank * T:(rank + 1) * T]  # each query's stream position
    mask = torch.arange(k.shape[0])[None, :] <= place[:, None]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                            enable_gqa=True)


def planted(defect: str, fn):
    """fn() with `defect` planted (`plant`), undone after."""
    patches = plant(defect)
    originals = [(m, a, getattr(m, a)) for m, a, _ in patches]
    for m, a, f in patches:
        setattr(m, a, f)
    try:
        return fn()
    finally:
        for m, a, f in originals:
            setattr(m, a, f)


def layout(name: str, work: str, results: list) -> None:
    from megagrpo.model.gpt import build_model
    from megagrpo.model.optim import optimizer_step
    from megagrpo.runtime.distributed import init_distributed, training_layout
    from megagrpo.train.passes import Passes

    tp, cp = LAYOUTS[name]
    cfg = make_config(tp, 1, True)
    cfg.parallel.cp = cp
    info = init_distributed(cfg.parallel, cfg.model)
    ranks, groups = training_layout(cfg.parallel, cfg.model, info)
    gpt = build_model(cfg.model, cfg.parallel, seed=7)
    ddp, opt = ddp_and_optimizer(gpt, cfg.optim)
    passes = Passes(cfg, ranks, groups, packed=False)
    batch = global_batch()
    rows = batch.num_seqs // ranks.dp
    mine = batch.select(torch.arange(ranks.dp_rank * rows, (ranks.dp_rank + 1) * rows),
                        batch.ids.shape[1])
    plan = passes.plan(mine, cfg.compute.micro_batch_size)
    rec = {"layout": name, "rank": info.rank, "dp": ranks.dp, "cp": ranks.cp,
           "widths": [mb.batch.ids.shape[1] for mb in plan]}
    cfg.compute.fused_output_layer = False
    logp = passes.logprobs(ddp, batch)
    cfg.compute.fused_output_layer = True
    logp_fused = passes.logprobs(ddp, batch)
    out = run_passes(passes, ddp, opt, mine, cfg, RUNS)
    rec["reports"] = {k: rep for k, (_, rep) in out.items()}
    saved = {"logp": logp, "logp_fused": logp_fused,
             **{k: g for k, (g, _) in out.items()}}
    if name == "cp2":
        for defect in DEFECTS:
            saved[defect] = planted(defect, partial(run_passes, passes, ddp, opt, mine, cfg,
                                                    ["grpo_logits"]))["grpo_logits"][0]
    if cp > 1:  # packed micro-batches: each row cut into its own 2 x cp chunks
        packed = Passes(cfg, ranks, groups, packed=True)
        rec["packed_rows"] = [len(mb.index) for mb in packed.plan(mine, 1)]
        saved["packed_logp"] = packed.logprobs(ddp, batch)
        out = run_passes(packed, ddp, opt, mine, cfg, PACKED_RUNS)
        rec["packed_reports"] = {k: rep for k, (_, rep) in out.items()}
        saved.update({f"packed_{k}": g for k, (g, _) in out.items()})
        if name == "cp2":
            saved[PACKED_DEFECT] = planted(PACKED_DEFECT, partial(
                run_passes, packed, ddp, opt, mine, cfg, ["grpo_logits"]))["grpo_logits"][0]
    # the optimizer's grad norm of GRPO's gradients (megatron's, over the model-parallel ranks)
    run_passes(passes, ddp, opt, mine, cfg, ["grpo_logits"])
    rec["grad_norm"] = optimizer_step(ddp, opt)[1]
    torch.save(saved, os.path.join(work, f"grads_{name}_{info.rank}.pt"))
    results.append(rec)
    dist.barrier()


def main():
    args = worker_args(layouts=",".join(LAYOUTS))
    results: list = []
    for name in args.layouts.split(","):
        layout(name, args.work, results)
    write_results(results, args.work, flat=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
