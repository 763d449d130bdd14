"""The GRPO training step's two model passes on one device, as megagrpo runs them: its
megatron-core `GPTModel` (`megagrpo.model.gpt.build_model`, megatron DDP around it), the update pass
(forward + backward through the fused GRPO loss, `megagrpo.train.losses.grpo_loss`) and the scoring
pass (forward only, log-probs, `losses.logprob_loss`), both through
`megagrpo.train.passes.Passes.run` (megatron's schedule). Timed for each compute.compile_layers
mode, micro-batch layout (padded: rows right-padded to their longest; packed: rows end to end) and
output path (the fused output layer: hidden states -> loss, no logits; the logits path: megatron's
output layer and the logits kernels).

    python benchmarks/gpu_step.py --device cuda --compile both --compiled-layouts padded \
        --out F.jsonl                                                # the H200 run
    python benchmarks/gpu_step.py --device cpu --shape tiny --compile off     # the smoke test
    python benchmarks/gpu_step.py --table F.jsonl [--write docs/performance.md]

Shapes: `gpu` is a Qwen2.5-1.5B-like decoder (hidden 2048, 16 layers, 16 query heads / 8 KV
heads of 128, FFN 5632, vocab 151936, untied, bf16) on 8 sequences of a 256-token prompt and a
completion, lengths spread evenly over 1024..2048 tokens (12,288 real tokens, 16,384 padded;
10,240 loss tokens); `tiny` a toy for the CPU smoke test. One micro-batch holds every row.

Figures per row (one JSON line per compile mode x layout x output path):
  update_s, score_s      median seconds of one update / scoring pass (after a warm-up pass,
                         two when compiled; the optimizer step is not part of it);
                         first_update_s, first_score_s: the warm-up passes' seconds
  tokens_per_s_*         real tokens (prompt + completion) / seconds
  tflops_*               useful FLOPs / seconds / 1e12, where (benchmarks/_workloads.py
                         `forward_flops`, the CPU benchmarks' floor) a forward is
                         F = 2 N T + 2 d L sum_i n_i (n_i + 1) + 2 H V T_loss:
                         N = matrix-multiply weights of the decoder layers (q, k, v, o, gate,
                         up, down), T = real tokens, n_i = each row's real length, d = heads x
                         head_dim, L = layers (causal attention, QK^T and PV), H x V = the
                         output layer at the T_loss loss positions (the only ones that need
                         logits); the update is 3 F (forward + backward), the scoring pass F.
                         Padding is not useful work: a padded layout pays for it in time.
  mfu_*                  tflops / the bf16 (or the model's dtype) torch.mm rate measured in the
                         same process at 8192^3 on CUDA (2048^3 on CPU): `mm_tflops`
  peak_gib_*             torch.cuda.max_memory_allocated during the pass (CPU: the harness's
                         peak extra allocation + what was allocated before), GiB
  compile_s              compile mode only: the warm-up passes' extra seconds over timed ones
                         (dynamo + inductor), per row; `dynamo_compile_s` dynamo's total so far
  loss_rel_diff, grad_rel_diff, grad_norm_rel_diff, logp_max_abs_diff
                         against the reference pass (eager, padded, the first --outputs path:
                         fused by default; run in the same process from the same weights and
                         batch; `reference` names it): the step loss
                         |a - b| / |b|, the whole gradient ||a - b|| / ||b||, the gradient
                         norm, the scored log-probs at loss tokens; `ok`: within the dtype's
                         tolerance (`TOLERANCE`). The process exits 1 when a row is not ok.
  error                  a row whose passes raised: the exception (the next row still runs:
                         one GPU session brings back every figure it can)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _common import add_out_and_table  # noqa: E402
from _harness import emit, peak_extra_bytes, sync, time_samples  # noqa: E402

SHAPES = {
    "gpu": dict(hidden=2048, layers=16, heads=16, kv=8, head_dim=128, ffn=5632, vocab=151936,
                dtype="bfloat16", rows=8, seq=2048, prompt=256, min_len=1024),
    # the "gpu" layer shape in fp32 (4 layers, half the tokens): compiled vs eager without bf16
    # rounding, the check behind a bf16 difference
    "gpu32": dict(hidden=2048, layers=4, heads=16, kv=8, head_dim=128, ffn=5632, vocab=151936,
                  dtype="float32", rows=4, seq=1024, prompt=128, min_len=512),
    "tiny": dict(hidden=64, layers=2, heads=4, kv=2, head_dim=16, ffn=128, vocab=256,
                 dtype="float32", rows=4, seq=32, prompt=6, min_len=12),
}
TOLERANCE = {  # against the eager padded fused pass: same weights, same batch
    # bf16: each path rounds its activations at different points (fused vs logits output
    # layer, compiled kernels, packing's attention grid); the loss and gradient differ by a
    # few bf16 ulps accumulated over the layers
    "bfloat16": dict(loss=2e-2, grad=5e-2, logp=0.25),
    "float32": dict(loss=1e-4, grad=1e-4, logp=1e-4),
}
DOC_START = "<!-- gpu step table: generated by benchmarks/gpu_step.py --table"
DOC_END = "<!-- end of gpu step table -->"
GIB = 2.0 ** 30


def overrides(s: dict, fused: bool) -> list[str]:
    """The recipe of the benchmark's model and passes (megagrpo's config keys)."""
    return [f"model.hidden_size={s['hidden']}", f"model.num_layers={s['layers']}",
            f"model.num_attention_heads={s['heads']}", f"model.num_query_groups={s['kv']}",
            f"model.head_dim={s['head_dim']}", f"model.ffn_hidden_size={s['ffn']}",
            f"model.vocab_size={s['vocab']}", f"model.dtype={s['dtype']}",
            f"model.max_position_embeddings={s['seq']}", "model.rope_theta=1000000.0",
            "algo.beta=0.04", "algo.kl_estimator=k3", "rollout.temperature=1.0",
            f"rollout.max_tokens={s['seq'] - s['prompt']}",
            # every row in one micro-batch (padded: rows x longest; packed: summed lengths)
            f"compute.micro_batch_size={s['rows']}",
            f"compute.micro_batch_tokens={s['rows'] * s['seq']}",
            "compute.skip_zero_advantage=false", f"compute.fused_output_layer={str(fused).lower()}",
            "log.progress=false"]


def lengths_of(s: dict) -> list[int]:
    """Each row's prompt + completion length: spread evenly over min_len..seq."""
    n = s["rows"]
    return [s["min_len"] + (s["seq"] - s["min_len"]) * i // max(1, n - 1) for i in range(n)]


def make_batch(s: dict):
    """The GRPO batch (CPU tensors, as megagrpo's trainer builds it): random ids, one advantage
    per sequence, vLLM log-probs of -1."""
    from megagrpo.parallel.batch import pack

    g = torch.Generator().manual_seed(0)
    lens = lengths_of(s)
    prompts = [torch.randint(1, s["vocab"], (s["prompt"],), generator=g).tolist() for _ in lens]
    comps = [torch.randint(1, s["vocab"], (n - s["prompt"],), generator=g).tolist() for n in lens]
    lps = [[-1.0] * len(c) for c in comps]
    return pack(prompts, comps, lps, torch.randn(len(lens), generator=g), pad_id=0)


def init(device: torch.device, cfg):
    """torch.distributed (world size 1) and megatron's model-parallel state, megagrpo's way.
    On CUDA the default group is `cpu:gloo,cuda:nccl`: megagrpo's loss normalisers
    (`Passes.counts`) all-reduce CPU tensors, which NCCL alone refuses."""
    import torch.distributed as dist

    from megagrpo.runtime.distributed import init_distributed, torchrun_env, training_layout

    if device.type == "cuda" and not dist.is_initialized():
        rank, world, local = torchrun_env()
        torch.cuda.set_device(local)
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=rank, world_size=world)
    info = init_distributed(cfg.parallel, cfg.model)
    if info.device.type != device.type:
        raise SystemExit(f"gpu_step: --device {device.type}, but megagrpo runs on "
                         f"{info.device.type} here")
    return training_layout(cfg.parallel, cfg.model, info)


def mm_tflops(device: torch.device, dtype: torch.dtype) -> tuple[float, int]:
    """torch.mm's rate at n^3 on `device` in `dtype` (best of the timed calls), TFLOP/s."""
    if device.type != "cuda":
        from megagrpo.runtime.machine import gemm_gflops

        rate, n = gemm_gflops(str(dtype).removeprefix("torch."), torch.get_num_threads(),
                              size=512, iters=3)
        return rate / 1e3, n
    n = 8192
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    for _ in range(3):
        torch.mm(a, b)
    samples = time_samples(lambda: [torch.mm(a, b) for _ in range(10)], device, warmup=1,
                           iters=3)
    return 2.0 * n ** 3 * 10 / min(samples) / 1e12, n


class Step:
    """The model, its DDP wrapper and megagrpo's passes over one batch, on one device."""

    def __init__(self, s: dict, device: torch.device, output: str = "fused"):
        from megagrpo.config.train import load_config
        from megagrpo.model.gpt import build_model
        from megagrpo.model.optim import wrap_ddp
        from megagrpo.train.passes import Passes

        self.s, self.device = s, device
        self.cfg = load_config(None, overrides(s, fused=output == "fused"))
        self.cfg.validate()
        ranks, groups = init(device, self.cfg)
        t0 = time.perf_counter()
        self.gpt = build_model(self.cfg.model, self.cfg.parallel, seed=3)
        self.build_s = time.perf_counter() - t0
        self.ddp = wrap_ddp(self.gpt, self.cfg.optim)
        self.passes = Passes(self.cfg, ranks, groups)
        self.batch = make_batch(s)
        self.m = s["rows"]
        # old / reference log-probs near the policy's own (ratios ~1, a small KL): scored once
        self.passes.packed = False
        _, logp = self.score()
        g = torch.Generator().manual_seed(1)
        noise = lambda: 0.05 * torch.randn(logp.shape, generator=g)  # noqa: E731
        self.batch.old_logp = torch.where(self.batch.mask, logp + noise(), 0.0)
        self.batch.ref_logp = torch.where(self.batch.mask, logp + noise(), 0.0)

    def set_path(self, layout: str, output: str) -> None:
        self.passes.packed = layout == "packed"
        self.cfg.compute.fused_output_layer = output == "fused"

    def plan(self) -> list:
        # on the device before the timed passes (forward_step would copy them in each pass)
        from megagrpo.parallel.batch import to_device

        return [to_device(mb, self.device) for mb in self.passes.plan(self.batch, self.m)]

    def update(self, plan: list | None = None) -> float:
        """One update pass (gradients into DDP's buffers, zeroed first); the step loss."""
        from megagrpo.train.losses import grpo_loss

        plan = plan or self.plan()
        P = self.passes
        ctx = P.loss_context(scale=len(plan) * P.ranks.dp, counts=P.counts(self.batch, len(plan)),
                             algo=self.cfg.algo, inplace_backward=self.cfg.compute.inplace_backward)
        self.ddp.zero_grad_buffer()
        out = P.run(self.ddp, partial(grpo_loss, ctx), plan, self.batch.ids.shape[1], self.m)
        return float(sum(float(o["loss"]) for o in out))

    def score(self, plan: list | None = None) -> tuple[list, torch.Tensor]:
        """One scoring pass: the micro-batches' reports and the log-probs [N, S] (CPU)."""
        from megagrpo.parallel.batch import unplan
        from megagrpo.train.losses import logprob_loss

        plan = plan or self.plan()
        P = self.passes
        out = P.run(self.ddp, partial(logprob_loss, P.loss_context()), plan,
                    self.batch.ids.shape[1], self.m, forward_only=True)
        return out, unplan([o["logp"].float().cpu() for o in out], plan,
                           tuple(self.batch.ids.shape))

    def grad(self) -> torch.Tensor:
        """The whole gradient (DDP's fp32 main grads) as one flat fp32 CPU tensor: nothing of
        the benchmark's own stays on the device while peak memory is measured."""
        return torch.cat([p.main_grad.reshape(-1).float().cpu() for p in self.ddp.parameters()])


def real_tokens(s: dict) -> int:
    return sum(lengths_of(s))


def flops(cfg, s: dict, batch) -> tuple[float, float]:
    """(update, scoring) useful FLOPs (module doc)."""
    from _workloads import forward_flops

    f = forward_flops(cfg.model, torch.tensor(lengths_of(s)), int(batch.mask.sum()))
    return 3.0 * f, f


def peak_gib(fn, device: torch.device) -> float:
    """Peak memory during `fn()`: CUDA's max_memory_allocated; on CPU the harness's peak extra
    allocation plus what torch held before (tensors of the model and the batch)."""
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        sync(device)
        return torch.cuda.max_memory_allocated(device) / GIB
    return peak_extra_bytes(fn, device) / GIB


def timed(fn, device: torch.device, iters: int, warmup: int) -> tuple[float, float]:
    """(the `warmup` first calls' seconds, median of the next `iters`)."""
    samples = time_samples(fn, device, warmup=0, iters=iters + warmup)
    return sum(samples[:warmup]), statistics.median(samples[warmup:])


def reference(step: Step, output: str) -> dict:
    """The eager padded pass through `output` (fused, the default): loss, gradient, scored
    log-probs."""
    step.set_path("padded", output)
    plan = step.plan()
    loss = step.update(plan)
    grad = step.grad()
    _, logp = step.score(plan)
    return dict(loss=loss, grad=grad, grad_norm=float(grad.norm()), logp=logp)


def measure(step: Step, layout: str, output: str, ref: dict, iters: int, warmup: int) -> dict:
    """One row: the update and scoring passes of this layout and output path timed after
    `warmup` passes, their peak memory, and their results against `ref`."""
    s, dev, b = step.s, step.device, step.batch
    step.set_path(layout, output)
    plan = step.plan()
    processed = sum(mb.packed.ids.numel() if mb.packed is not None else mb.batch.ids.numel()
                    for mb in plan)
    first_u, upd = timed(lambda: step.update(plan), dev, iters, warmup)
    loss = step.update(plan)
    grad = step.grad()
    first_s, sco = timed(lambda: step.score(plan), dev, iters, warmup)
    _, logp = step.score(plan)
    peak_u = peak_gib(lambda: step.update(plan), dev)
    peak_s = peak_gib(lambda: step.score(plan), dev)
    f_upd, f_sco = flops(step.cfg, s, b)
    tol = TOLERANCE[s["dtype"]]
    mask = b.mask
    diffs = dict(
        loss_rel_diff=abs(loss - ref["loss"]) / max(abs(ref["loss"]), 1e-30),
        grad_rel_diff=float((grad - ref["grad"]).norm() / ref["grad"].norm().clamp_min(1e-30)),
        grad_norm_rel_diff=abs(float(grad.norm()) - ref["grad_norm"]) / max(ref["grad_norm"],
                                                                           1e-30),
        logp_max_abs_diff=float((logp - ref["logp"])[mask].abs().max()))
    ok = (diffs["loss_rel_diff"] <= tol["loss"] and diffs["grad_rel_diff"] <= tol["grad"]
          and diffs["grad_norm_rel_diff"] <= tol["grad"] and diffs["logp_max_abs_diff"]
          <= tol["logp"])
    return dict(layout=layout, output=output, processed_tokens=processed,
                update_s=round(upd, 5), score_s=round(sco, 5),
                first_update_s=round(first_u, 3), first_score_s=round(first_s, 3),
                update_flops=f_upd, score_flops=f_sco,
                peak_gib_update=round(peak_u, 3), peak_gib_score=round(peak_s, 3),
                loss=loss, grad_norm=float(grad.norm()),
                **{k: float(f"{v:.3g}") for k, v in diffs.items()}, ok=ok)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads)"


def describe(step: Step, shape: str, rate: float, n: int) -> dict:
    """The fields every row of this process shares: device, model, batch, torch.mm rate."""
    from megagrpo.model.gpt import attention_impl_name, layer_spec_name

    s = step.s
    common = dict(bench="gpu_step", device=device_name(step.device), torch=torch.__version__,
                  shape=shape, dtype=s["dtype"], rows=s["rows"], seq=s["seq"],
                  real_tokens=real_tokens(s), loss_tokens=int(step.batch.mask.sum()),
                  params=sum(p.numel() for p in step.gpt.parameters()),
                  layer_spec=layer_spec_name(step.cfg.parallel),
                  attention=attention_impl_name(step.cfg.parallel),
                  mm_tflops=round(rate, 2), mm_n=n, build_s=round(step.build_s, 1))
    if step.device.type == "cpu":
        common["load_avg_1m"] = round(os.getloadavg()[0], 2)
    return common


def rates(r: dict, rate: float) -> dict:
    """A measured row with its tokens/s, TFLOP/s and MFU per pass."""
    for kind in ("update", "score"):
        sec = r[f"{kind}_s"]
        r[f"tokens_per_s_{kind}"] = round(r["real_tokens"] / sec, 1)
        r[f"tflops_{kind}"] = round(r[f"{kind}_flops"] / sec / 1e12, 3)
        r[f"mfu_{kind}"] = round(r[f"{kind}_flops"] / sec / 1e12 / rate, 4)
    return r


def run(args) -> bool:
    """Every layout x output row of each compile mode (eager first: its rows are written
    before the compile starts); False when a row is not ok."""
    device = torch.device(args.device)
    outputs = args.outputs.split(",")
    step = Step(dict(SHAPES[args.shape]), device, outputs[0])
    rate, n = mm_tflops(device, getattr(torch, step.s["dtype"]))
    common = describe(step, args.shape, rate, n)
    print(f"[gpu_step] {time.strftime('%H:%M:%S')} built {common['params'] / 1e6:.1f}M params "
          f"in {step.build_s:.1f} s on {common['device']}; torch.mm {rate:.1f} TFLOP/s",
          flush=True)
    ref = reference(step, outputs[0])
    ok = True
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    for compiled in modes:
        dynamo_before = 0.0
        if compiled:
            from megagrpo.model.compile import compile_layers

            compile_layers(step.gpt)
            dynamo_before = _dynamo_seconds()
        layouts = (args.compiled_layouts or args.layouts) if compiled else args.layouts
        for layout in layouts.split(","):
            for output in outputs:
                r = dict(common, compile_layers=compiled, layout=layout, output=output,
                         reference=f"eager padded {outputs[0]}")
                ok &= one_row(step, r, ref, args, rate, dynamo_before)
    return ok


def one_row(step: Step, r: dict, ref: dict, args, rate: float, dynamo_before: float) -> bool:
    """Measures, records and prints one row (`r`: its fixed fields); whether it is ok."""
    compiled, mode = r["compile_layers"], "on" if r["compile_layers"] else "off"
    what = f"compile={mode} {r['layout']} {r['output']}"
    try:
        # compiled: a second untimed pass (on CPU the first pass after the compile still
        # took 50x the next ones: dynamo's lazily compiled pieces)
        r = rates(dict(r, **measure(step, r["layout"], r["output"], ref, args.iters,
                                    2 if compiled else 1)), rate)
    except Exception as e:  # recorded (the row says what failed), the next row runs:
        # one GPU session has to bring back every figure it can
        traceback.print_exc()
        r.update(ok=False, error=f"{type(e).__name__}: {e}"[:1500])
        emit(r, args.out)
        print(f"[gpu_step] {time.strftime('%H:%M:%S')} {what}: FAILED {r['error'][:300]}",
              flush=True)
        return False
    if compiled:
        r["compile_s"] = round(r["first_update_s"] - 2 * r["update_s"]
                               + r["first_score_s"] - 2 * r["score_s"], 1)
        r["dynamo_compile_s"] = round(_dynamo_seconds() - dynamo_before, 1)
        r.update(_graphs())
    emit(r, args.out)
    print(f"[gpu_step] {time.strftime('%H:%M:%S')} {what}: update {r['update_s']:.3f} s "
          f"({r['mfu_update']:.1%} MFU), score {r['score_s']:.3f} s ({r['mfu_score']:.1%}), "
          f"ok={r['ok']}", flush=True)
    return r["ok"]


def _graphs() -> dict:
    """Graphs dynamo made so far and its graph breaks (one graph a layer shape and grad mode
    is the goal: `megagrpo.model.compile`)."""
    from torch._dynamo.utils import counters

    from megagrpo.model.compile import graph_count

    return dict(graphs=graph_count(), graph_breaks=int(sum(counters["graph_break"].values())))


def _dynamo_seconds() -> float:
    from torch._dynamo.utils import calculate_time_spent

    return float(calculate_time_spent().get("total_wall_time", 0.0))


# ---------------------------------------------------------------------------------------------
# docs/performance.md's table


def table(path: str) -> str:
    """The markdown table of the JSON lines in `path` (the newest row of each compile mode x
    layout x output path); a one-line note when the file does not exist yet."""
    p = Path(path)
    if not p.exists():
        return f"(no results yet: {path} is written by `bash benchmarks/gpu_check.sh`)"
    rows: dict[tuple, dict] = {}
    for line in p.read_text().splitlines():
        r = json.loads(line) if line.strip() else None
        if r and r.get("bench") == "gpu_step":
            rows[(r["compile_layers"], r["layout"], r["output"])] = r
    out = ["| compile_layers | layout | output layer | update | update TFLOP/s (MFU) | "
           "score | score TFLOP/s (MFU) | tokens/s update / score | peak GiB update / score | "
           "first passes (compile) | loss / grad rel. diff vs eager |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(rows, key=lambda k: (k[0], k[1] != "padded", k[2] != "fused")):
        r = rows[key]
        if "error" in r:
            out.append(f"| {'on' if r['compile_layers'] else 'off'} | {r['layout']} | "
                       f"{r['output']} | failed: {r['error'][:120]} |" + " |" * 7)
            continue
        comp = "-" if not r["compile_layers"] else (
            f"{r['compile_s']:.0f} s" if r["compile_s"] >= 0.5 else "none (graph cached)")
        out.append(
            f"| {'on' if r['compile_layers'] else 'off'} | {r['layout']} "
            f"({r['processed_tokens']} tokens) | {r['output']} | {r['update_s'] * 1e3:.0f} ms | "
            f"{r['tflops_update']:.0f} ({r['mfu_update']:.0%}) | {r['score_s'] * 1e3:.0f} ms | "
            f"{r['tflops_score']:.0f} ({r['mfu_score']:.0%}) | {r['tokens_per_s_update']:.0f} / "
            f"{r['tokens_per_s_score']:.0f} | {r['peak_gib_update']:.1f} / "
            f"{r['peak_gib_score']:.1f} | {comp} | {r['loss_rel_diff']:.1e} / "
            f"{r['grad_rel_diff']:.1e} |")
    if rows:
        r = next(iter(rows.values()))
        out.append("")
        out.append(f"{r['device']}, torch {r['torch']}, {r['dtype']}, {r['params'] / 1e9:.2f}B "
                   f"parameters, {r['rows']} rows of up to {r['seq']} tokens ({r['real_tokens']} "
                   f"real, {r['loss_tokens']} loss tokens); torch.mm {r['mm_tflops']:.0f} TFLOP/s "
                   f"at {r['mm_n']}^3; {r['layer_spec']} layer spec, {r['attention']} attention.")
    if "_h200" in p.name:  # gpu_step_h200.jsonl -> gpu_step_fp32_h200.jsonl beside it
        out += _fp32_check(p.with_name(p.name.replace("_h200", "_fp32_h200")))
    return "\n".join(out)


def _fp32_check(p: Path) -> list[str]:
    """Lines for the fp32 rows beside the bf16 file (`--shape gpu32`): compiled vs eager
    without bf16 rounding; nothing when the file does not exist."""
    if not p.exists():
        return []
    rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("bench") == "gpu_step" and "error" not in r]
    if not rows:
        return []
    r0 = rows[0]
    out = ["", f"fp32 check (`--shape {r0['shape']}`, {p.name}: {r0['params'] / 1e9:.2f}B "
               f"parameters, {r0['rows']} rows of up to {r0['seq']} tokens, torch.mm "
               f"{r0['mm_tflops']:.0f} TFLOP/s fp32):", "",
           "| compile_layers | layout | output layer | update | update MFU | loss / grad rel. "
           "diff vs eager | log-prob max abs diff | within fp32 tolerance |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {'on' if r['compile_layers'] else 'off'} | {r['layout']} | {r['output']} "
                   f"| {r['update_s'] * 1e3:.0f} ms | {r['mfu_update']:.0%} | "
                   f"{r['loss_rel_diff']:.1e} / {r['grad_rel_diff']:.1e} | "
                   f"{r['logp_max_abs_diff']:.1e} | {'yes' if r['ok'] else 'no'} |")
    return out


def write_doc(doc: str, generated: str) -> None:
    """`generated` between the markers of `doc` (the start marker's line and the end marker
    kept)."""
    text = Path(doc).read_text()
    i = text.index(DOC_START)
    start = text.index("\n", i) + 1
    end = text.index(DOC_END, start)
    Path(doc).write_text(text[:start] + generated + "\n" + text[end:])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES),
                    help="gpu on CUDA, tiny on CPU by default")
    ap.add_argument("--compile", default="off", choices=("off", "on", "both"),
                    help="compute.compile_layers; both: the eager rows first (written before "
                    "the compile starts, so a compile that hangs loses none of them), then "
                    "the layers compiled in the same process (one model build)")
    ap.add_argument("--layouts", default="padded,packed")
    ap.add_argument("--compiled-layouts", default=None,
                    help="the layouts of the compiled rows (default: --layouts); each layout "
                    "is another graph to compile")
    ap.add_argument("--outputs", default="fused,logits")
    ap.add_argument("--iters", type=int, default=None, help="timed passes (3 CUDA, 1 CPU)")
    add_out_and_table(ap, "only print the markdown table of these result lines")
    ap.add_argument("--write", default=None, metavar="DOC",
                    help="with --table: write it between the doc's gpu step markers")
    args = ap.parse_args(argv)
    if args.table:
        generated = table(args.table)
        print(generated)
        if args.write:
            write_doc(args.write, generated)
        return
    for name, allowed in (("layouts", ("padded", "packed")), ("outputs", ("fused", "logits"))):
        bad = set(getattr(args, name).split(",")) - set(allowed)
        if bad:
            raise SystemExit(f"gpu_step: --{name} {sorted(bad)}: use {', '.join(allowed)}")
    args.shape = args.shape or ("gpu" if args.device == "cuda" else "tiny")
    args.iters = args.iters or (3 if args.device == "cuda" else 1)
    if not run(args):
        print("[gpu_step] a path's loss, gradient or log-probs differ from the reference beyond "
              "tolerance (ok=false above)", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
