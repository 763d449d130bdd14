"""Run on local ranks (4 ranks, gloo) by tests/test_seqpar.py: sequence parallelism, activation
recomputation and the MoE auxiliary losses, in one launch.

- dense (megatron's own loss): the tiny HF Llama at TP=2 + SP, logits and one step's reduced
  gradients and grad norm (tests/_foundation_worker.check_and_step) for the parent's float64
  reference;
- dense (megagrpo's passes): a tiny policy at TP=2 x DP=2 with and without SP, with SP plus
  recompute selective / full, and with SP on packed micro-batches (rows end to end, T odd: SP
  pads it): the scoring pass's log-probs and the finalized gradients of GRPO (logits path and
  fused output layer, at loss positions and at every position), GSPO and the supervised loss,
  each compared on this rank with the padded TP=2 run without SP (same shards);
- MoE (Qwen3-MoE, load-balancing and z-loss on): TP=1 x DP=4, TP=2 x EP=2 + SP, TP=2 x EP=2
  without SP and TP=1 x EP=2 x DP=4 with the plain and with the distributed optimizer (Adam
  state of the dense weights sharded over the 4 DP ranks, of the experts over their 2
  expert-DP ranks), each DP rank training on its own slice of the parent's global batch:
  reduced gradients under HF names with the grad norm (not with the distributed optimizer,
  whose ranks reduce only their own shard), the routing monitor's aux / z-loss and tokens per
  expert, the tokens entering this rank's experts, and the weights after the step; and packed
  micro-batches (load-balancing loss on) through megagrpo's forward step at TP=1 x DP=4 and at
  TP=2 x EP=2 + SP, each half of PACKED_LENGTHS' rows one micro-batch (T = 19: SP pads it),
  the same half on both DP ranks of a TP=1 pair so that both layouts average the same slices;
- routing replay through the trainer's scoring pass (tests/_replay_checks.py).
WORK/results.json (every rank's records)."""
import dataclasses
import os

import torch
import torch.distributed as dist

from tests._foundation_worker import ce_forward, check_and_step, export_grads
from tests._fused_output_worker import grads, make_batch, make_config
from tests._replay_checks import replay_scores
from tests.support.launch import worker_args, write_results
from tests.support.megatron import ddp_and_optimizer

DENSE = {  # name: (sequence_parallel, recompute, packed)
    "tp2": (False, "none", False),
    "tp2_sp": (True, "none", False),
    "tp2_sp_selective": (True, "selective", False),
    "tp2_sp_full": (True, "full", False),
    "tp2_sp_packed": (True, "none", True),
}
MOE = {  # name: (tp, ep, sequence_parallel, distributed optimizer, packed)
    "moe_tp1": (1, 1, False, False, False),
    "moe_tp2_ep2_sp": (2, 2, True, False, False),
    "moe_tp2_ep2": (2, 2, False, False, False),
    "moe_ep2": (1, 2, False, False, False),
    "moe_ep2_distopt": (1, 2, False, True, False),
    "moe_tp1_packed": (1, 1, False, False, True),
    "moe_tp2_ep2_sp_packed": (2, 2, True, False, True),
}
PACKED_LENGTHS = (12, 7, 9, 5)  # the MoE rows' lengths when packed: halves of T = 19 and 14
ADAM_EPS = 1e-4  # large enough that the first Adam step (g / (|g| + eps)) is smooth in g, so
# the parent can compare the weights after it with a float64 step at fp32 tolerance
AUX_COEF, Z_COEF = 0.5, 0.01  # HF-form coefficients, large enough to move the router gradient


def dense_native(work: str, results: list) -> None:
    from megagrpo.config.model import ParallelConfig
    from megagrpo.hf import model_config_from_hf

    ref = torch.load(os.path.join(work, "ref.pt"))
    parallel = ParallelConfig(tp=2, sequence_parallel=True, make_vocab_size_divisible_by=56)
    mcfg = model_config_from_hf(os.path.join(work, "llama"))
    check_and_step("llama", mcfg, parallel, "tp2_sp", work, ref, results)
    dist.barrier()


def dense_passes(name: str, base: dict, results: list) -> None:
    """One DENSE layout's scoring and update passes; `base`: the first layout's tensors."""
    from megagrpo.model.gpt import build_model
    from megagrpo.model.optim import build_optimizer, wrap_ddp
    from megagrpo.runtime.distributed import init_distributed, training_layout
    from megagrpo.train.losses import grpo_loss, sft_loss
    from megagrpo.train.passes import Passes

    sp, recompute, packed = DENSE[name]
    cfg = make_config(2, 1, True)
    cfg.parallel.sequence_parallel, cfg.compute.recompute = sp, recompute
    info = init_distributed(cfg.parallel, cfg.model)
    ranks, groups = training_layout(cfg.parallel, cfg.model, info)
    gpt = build_model(cfg.model, cfg.parallel, seed=7, recompute=(recompute, 1))
    ddp = wrap_ddp(gpt, cfg.optim)
    opt = build_optimizer(ddp, cfg.optim)
    passes = Passes(cfg, ranks, groups, packed=packed)
    m = cfg.compute.micro_batch_size
    batch = make_batch(3, 1)
    width = batch.ids.shape[1]  # odd, so that SP pads (the last column holds no loss token)
    batch = batch.select(torch.arange(batch.num_seqs), width - 1 + width % 2)
    batch.lengths = batch.lengths.clamp(max=batch.ids.shape[1])  # rows cut with the batch
    calls = call_counter(gpt)
    g = torch.Generator().manual_seed(5)  # old / ref log-probs independent of the layout
    batch.old_logp = torch.where(batch.mask, -4.6 + 0.3 * torch.randn(batch.mask.shape,
                                                                        generator=g), 0.0)
    batch.ref_logp = torch.where(batch.mask, -4.6 + 0.5 * torch.randn(batch.mask.shape,
                                                                        generator=g), 0.0)
    runs = {"grpo_logits": (grpo_loss, "grpo", True, False),
            "grpo_fused": (grpo_loss, "grpo", True, True),
            "grpo_all_positions": (grpo_loss, "grpo", False, False),
            "gspo_fused": (grpo_loss, "gspo", True, True),
            "sft_fused": (sft_loss, "grpo", True, True)}
    mine = {"logp": {f: None for f in (False, True)}}
    for fused in (False, True):
        cfg.compute.fused_output_layer = fused
        mine["logp"][fused] = passes.logprobs(ddp, batch)
    for key, (fn, agg, at_loss, fused) in runs.items():
        cfg.algo.loss_agg, cfg.compute.logits_at_loss_positions = agg, at_loss
        cfg.compute.fused_output_layer = fused
        before = dict(calls)
        mine[key] = grads(passes, ddp, opt, fn, batch, m, cfg.algo)[0]
        if key == "grpo_logits":  # forwards per micro-batch: 2 where recomputed
            n = len(passes.plan(batch, m))
            mine["forwards"] = {k: (calls[k] - before[k]) / n for k in calls}
    mine["widths_odd"] = sum((mb.batch.ids if mb.packed is None else mb.packed.ids).shape[1] % 2
                             for mb in passes.plan(batch, m))
    mine["packed"] = sum(mb.packed is not None for mb in passes.plan(batch, m))
    if not base:
        base.update(mine)
    rec = {"part": "dense", "layout": name, "rank": info.rank, "odd_widths": mine["widths_odd"],
           "packed": mine["packed"],
           "forwards": mine["forwards"],
           "logp_diff": max(float((mine["logp"][f] - base["logp"][f]).abs().max())
                            for f in (False, True))}
    for key in runs:
        rec[key] = max(float((a - b).norm() / b.norm().clamp_min(1e-30))
                       for a, b in zip(mine[key], base[key]))
    results.append(rec)
    dist.barrier()


def call_counter(gpt) -> dict[str, int]:
    """Forward calls of the first transformer layer and of its core attention."""
    layer = gpt.decoder.layers[0]
    calls = {"layer": 0, "core_attention": 0}

    def hook(key):
        def count(*_):
            calls[key] += 1
        return count

    layer.register_forward_pre_hook(hook("layer"))
    layer.self_attention.core_attention.register_forward_pre_hook(hook("core_attention"))
    return calls


def expert_counter(gpt) -> list[int]:
    """Counts the token rows entering this rank's routed experts (every MoE layer)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    seen = [0]

    def count(module, args, kwargs):
        seen[0] += int(args[0].shape[0])

    for mod in gpt.modules():
        if isinstance(mod, SequentialMLP):
            mod.register_forward_pre_hook(count, with_kwargs=True)
    return seen


def packed_rows(ids: torch.Tensor, lengths: tuple[int, ...]):
    """One packed micro-batch (`megagrpo.parallel.batch.MicroBatch`) of rows `ids` [b, S] cut to
    `lengths`, every next token of a row (not the row's last) a loss position."""
    from megagrpo.parallel.batch import Batch, plan_micro_batches

    n = torch.tensor(lengths)
    col = torch.arange(ids.shape[1])
    target = torch.roll(ids, -1, dims=1)
    mask = col[None] < n[:, None] - 1
    zeros = torch.zeros(ids.shape)
    batch = Batch(ids=ids.clone(), target=target, mask=mask, advantages=zeros,
                  rollout_logp=zeros, seq_valid=torch.ones(len(n), dtype=torch.bool), lengths=n)
    (mb,) = plan_micro_batches(batch, len(n), token_budget=int(n.sum()), packed=True)
    return mb


def packed_ce_forward(mb, model):
    """megagrpo's forward step (`megagrpo.train.passes.forward_step`: packed, logits at the loss
    positions) with the mean next-token cross-entropy (vocab-parallel) as its loss."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megagrpo.parallel.positions import take
    from megagrpo.train.passes import forward_step

    def ce(b, logits, positions):  # logits [1, n, V_local]
        tok = vocab_parallel_cross_entropy(logits.float(), take(b.target, positions)[None])
        loss = (tok * take(b.mask, positions)[None]).sum() / b.mask.sum()
        return loss, {"loss": loss.detach()}

    return forward_step(mb, model, loss_fn=ce)


def moe_layout(name: str, work: str, results: list) -> None:
    from megatron.core import parallel_state as ps

    from megagrpo.config.model import ParallelConfig
    from megagrpo.hf import load_hf_weights, model_config_from_hf
    from megagrpo.model.gpt import build_model
    from megagrpo.model.moe import RoutingMonitor, tp_slices, tracked_losses
    from megagrpo.model.optim import OptimConfig, forward_backward, optimizer_step
    from megagrpo.runtime.distributed import init_distributed
    from megagrpo.sync.source import export_hf

    tp, ep, sp, distopt, packed = MOE[name]
    ref = torch.load(os.path.join(work, "ref.pt"))
    # packed: no z-loss (megatron's, under SP, is the mean of the TP ranks' slice means, which
    # weighs the tokens of a stream padded to a multiple of tp unequally)
    mcfg = dataclasses.replace(model_config_from_hf(os.path.join(work, "qwen3_moe")),
                               moe_aux_loss_coef=AUX_COEF, moe_z_loss_coef=0 if packed else Z_COEF)
    parallel = ParallelConfig(tp=tp, ep=ep, sequence_parallel=sp, make_vocab_size_divisible_by=56)
    info = init_distributed(parallel, mcfg)
    gpt = build_model(mcfg, parallel, seed=7)
    load_hf_weights(gpt, os.path.join(work, "qwen3_moe"), mcfg, parallel,
                    tp_rank=info.tp_rank, pp_rank=info.pp_rank)
    ddp, opt = ddp_and_optimizer(gpt, OptimConfig(lr=1e-3, clip_grad=1.0, adam_eps=ADAM_EPS,
                                                  distributed_optimizer=distopt))
    monitor = RoutingMonitor(gpt, mcfg.num_layers, mcfg.num_experts,
                             losses=tracked_losses(mcfg), counts_here=info.tp_rank == 0,
                             group=dist.group.WORLD, tp_slices=tp_slices(parallel))
    seen = expert_counter(gpt)
    monitor.reset()
    ids, labels = ref["moe_ids"], ref["moe_labels"]
    dp, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    if packed:  # half r // (dp / 2) of the rows, end to end
        half = ids.shape[0] // 2
        lo = r // (dp // 2) * half
        forward_backward(ddp, packed_ce_forward, [packed_rows(ids[lo:lo + half],
                                                              PACKED_LENGTHS[lo:lo + half])],
                         1, seq_length=ids.shape[1], micro_batch_size=1)
    else:
        rows = ids.shape[0] // dp  # this DP rank's own slice of the global batch, one micro-batch
        mb = (ids[r * rows:(r + 1) * rows], labels[r * rows:(r + 1) * rows])
        forward_backward(ddp, ce_forward, [mb], 1, seq_length=ids.shape[1],
                         micro_batch_size=rows)
    if not distopt:
        export_grads(gpt, os.path.join(work, f"grad_qwen3_moe_{name}"), mcfg, parallel)
    metrics = monitor.metrics()
    ok, gnorm = optimizer_step(ddp, opt)
    export_hf(gpt, os.path.join(work, f"step_qwen3_moe_{name}"), mcfg, parallel)
    total = torch.tensor([float(seen[0])])
    dist.all_reduce(total)
    results.append({"part": "moe", "layout": name, "rank": info.rank, "model": "qwen3_moe",
                    "dp": dp, "step_ok": ok, "grad_norm": gnorm, "metrics": metrics,
                    "expert_rows": float(total), "tp": tp})
    dist.barrier()


def main():
    args = worker_args(parts="native,dense,moe,replay")
    parts, results = args.parts.split(","), []
    if "native" in parts:
        dense_native(args.work, results)
    if "dense" in parts:
        base: dict = {}
        for name in DENSE:
            dense_passes(name, base, results)
    if "moe" in parts:
        for name in MOE:
            moe_layout(name, args.work, results)
    if "replay" in parts:
        replay_scores(args.work, results)
    write_results(results, args.work, flat=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
