"""Benchmark the GRPO loss over vocab-parallel logits: time and memory of forward + backward.

Usage (from the repo root; the same command runs on CUDA unchanged):

    .venv/bin/python benchmarks/kernels.py                     # auto device, default sizes
    .venv/bin/python benchmarks/kernels.py --out benchmarks/results/kernels_cpu.jsonl
    python benchmarks/kernels.py --device cuda --check   # float64 check first, then timings

One JSON line per (path, TP) case: ``fwd_bwd_s`` is the median and ``fwd_bwd_min_s`` the
fastest of the timed iterations (on a shared CPU machine the min is the least noisy). Every
path computes the same thing: per-token log-probs with grad, entropy (no grad) and a clipped
GRPO loss with a k3 KL term, summed, then the gradient w.r.t. the logits
(``torch.autograd.grad``, so no ``.grad`` accumulation copy).

Paths:
- ``naive``: ``log_softmax`` of an fp32 copy + gather under autograd (the textbook way).
- ``megatron``: megatron-core ``tensor_parallel.vocab_parallel_cross_entropy`` (TP=1 only here,
  in a single-rank process group; no entropy: it has none).
- ``torch_chunked`` / ``torch_chunked_newgrad``: megagrpo's chunked pure-torch path with the
  gradient written into the logits buffer (``inplace_backward=True``) or into a new buffer.
- ``triton`` / ``triton_newgrad``: the Triton kernels (CUDA only: the interpreter is far too slow
  at these sizes).

TP>1 cases time one rank's share (logits ``[T, V/tp]``, targets drawn from the full vocab, so
most are not local) in one process; the cross-rank all_gather of a ``[tp, T, 4]`` fp32 tensor is
not included. ``naive`` and ``megatron`` run at TP=1 only.

Memory (see ``_harness``): peak bytes allocated during the call beyond what existed before it
(the logits and small inputs); ``peak_extra_pct`` is that over the logits' bytes. On GPU,
``achieved_GBps`` counts the minimum traffic of the fused paths (read the logits forward, read
and write them backward: 3x their bytes) against a measured device copy bandwidth.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import parser, print_table  # noqa: E402
from _harness import copy_bandwidth, emit, peak_extra_bytes, time_samples  # noqa: E402

from megagrpo.kernels import (  # noqa: E402
    LossSpec, TokenInputs, VocabPass, loss_from_logp, token_loss,
)
from megagrpo.kernels.dispatch import triton_can_run  # noqa: E402

SPEC = LossSpec(eps_low=0.2, eps_high=0.28, beta=0.04, kl_estimator="k3")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def make_inputs(t: int, v_local: int, tp: int, dtype: torch.dtype, device: torch.device) -> dict:
    g = torch.Generator(device="cpu").manual_seed(0)
    logits = (torch.randn(t, v_local, generator=g) * 2).to(device=device, dtype=dtype)
    target = torch.randint(0, v_local * tp, (t,), generator=g).to(device)
    mask = (torch.rand(t, generator=g) > 0.1).to(device)
    old = (-5 + torch.randn(t, generator=g)).to(device)
    adv = torch.randn(t, generator=g).to(device)
    ref = old + 0.1 * torch.randn(t, generator=g).to(device)
    return dict(logits=logits, target=target, inputs=TokenInputs(old, adv, mask, ref_logp=ref))


def naive_loss(x: torch.Tensor, inp: dict) -> torch.Tensor:
    logsm = torch.log_softmax(x.float(), dim=-1)
    logp = logsm.gather(1, inp["target"].clamp(0, x.shape[1] - 1)[:, None]).squeeze(1)
    with torch.no_grad():
        entropy = -(logsm.exp() * logsm).sum(dim=-1)
    return loss_from_logp(SPEC, inp["inputs"], logp, entropy)[0]


def megatron_loss(x: torch.Tensor, inp: dict) -> torch.Tensor:
    from megatron.core import tensor_parallel

    logp = -tensor_parallel.vocab_parallel_cross_entropy(x, inp["target"])
    return loss_from_logp(SPEC, inp["inputs"], logp)[0]


def fused_loss(impl: str, inplace: bool) -> Callable[[torch.Tensor, dict], torch.Tensor]:
    def loss(x: torch.Tensor, inp: dict) -> torch.Tensor:
        run = VocabPass(impl=impl, inplace_backward=inplace)
        return token_loss(x, inp["target"], SPEC, inp["inputs"], run=run)[0]
    return loss


PATHS: dict[str, Callable] = {
    "naive": naive_loss,
    "megatron": megatron_loss,
    "torch_chunked": fused_loss("torch", True),
    "torch_chunked_newgrad": fused_loss("torch", False),
    "triton": fused_loss("triton", True),
    "triton_newgrad": fused_loss("triton", False),
}


def init_megatron_tp1(device: torch.device) -> str | None:
    """A single-rank process group + megatron parallel_state, or the reason it is unavailable."""
    try:
        import torch.distributed as dist
        from megatron.core import parallel_state
    except ImportError as e:
        return f"megatron-core not importable: {e}"
    if not dist.is_initialized():
        import tempfile

        rdzv = os.path.join(tempfile.mkdtemp(), "rdzv")
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"file://{rdzv}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    return None


def skip_reason(path: str, tp: int, device: torch.device) -> str | None:
    if path in ("naive", "megatron") and tp != 1:
        return "needs the full vocab on one rank (TP=1 only)"
    if path.startswith("triton") and device.type != "cuda":
        return "Triton runs on CUDA only in this benchmark"
    if path.startswith("triton") and not triton_can_run(torch.empty(0, device=device)):
        return "triton not importable"
    if path == "megatron":
        return init_megatron_tp1(device)
    return None


def run_case(path: str, base: torch.Tensor, inp: dict, device: torch.device, iters: int) -> dict:
    """Time and measure one path on a fresh copy of ``base`` per call (copy not counted)."""
    loss_fn = PATHS[path]
    state = {}

    def setup():
        state.clear()
        state["x"] = base.clone().requires_grad_()

    def step():
        x = state.pop("x")
        (grad,) = torch.autograd.grad(loss_fn(x, inp).sum(), [x])
        return grad

    samples = time_samples(step, device, setup=setup, warmup=1, iters=iters)
    setup()
    peak = peak_extra_bytes(step, device)
    setup()
    with torch.no_grad():
        loss = loss_fn(state.pop("x"), inp).float()
    return dict(fwd_bwd_s=round(statistics.median(samples), 5),
                fwd_bwd_min_s=round(min(samples), 5), peak_extra_bytes=peak, loss=loss)


CHECK_V = (151936, 37981)  # Qwen's vocab (fp32) and a size no block divides (bf16)


def correctness_check(device: torch.device, impl: str, out: str | None = None,
                      vocabs: tuple[int, int] = CHECK_V) -> bool:
    """Kernel vs float64 log_softmax on 64 tokens on ``device`` (vocab sizes ``vocabs``: fp32,
    bf16); prints one JSON line.

    Meant for the GPU run, where the compiled kernels (not the interpreter) execute; the
    interpreter's smoke test passes small ``vocabs`` (it takes ~0.15 s per 1000 vocab entries).
    """
    from megagrpo.kernels import vocab_parallel_logprob

    worst = {}
    for dtype, v, temp in ((torch.float32, vocabs[0], 1.0), (torch.bfloat16, vocabs[1], 0.7)):
        g = torch.Generator(device="cpu").manual_seed(1)
        x = (torch.randn(64, v, generator=g) * 4).to(dtype)
        x[0, :] = 1e4 * torch.sign(torch.randn(v, generator=g)).to(dtype)
        t = torch.randint(0, v, (64,), generator=g)
        gl, gh = torch.randn(64, generator=g), torch.randn(64, generator=g)
        xd = x.to(device, copy=True).requires_grad_()
        logp, ent = vocab_parallel_logprob(xd, t.to(device), temperature=temp,
                                           with_entropy=True, impl=impl)
        (logp * gl.to(device) + ent * gh.to(device)).sum().backward()
        x64 = x.double().requires_grad_()
        logsm = torch.log_softmax(x64 / temp, dim=-1)
        lp64 = logsm.gather(1, t[:, None]).squeeze(1)
        ent64 = -(logsm.exp() * logsm).sum(-1)
        (lp64 * gl + ent64 * gh).sum().backward()
        ulp = torch.finfo(dtype).eps * x64.grad.abs() if dtype != torch.float32 else 0.0
        worst[str(dtype)] = dict(
            logp=float((logp.cpu() - lp64).abs().max()),
            entropy=float((ent.cpu() - ent64).abs().max()),
            grad_excess_over_ulp=float(((xd.grad.cpu().double() - x64.grad).abs() - ulp).max()))
    ok = all(w["logp"] < 2e-3 and w["entropy"] < 2e-3 and w["grad_excess_over_ulp"] < 1e-4
             for w in worst.values())
    emit(dict(check=f"{impl} vs float64", device=device.type, ok=ok, max_abs_err=worst), out)
    return ok


DOC_START = "<!-- kernels h200 table: generated by benchmarks/kernels.py --table"
DOC_END = "<!-- end of kernels h200 table -->"


def table(path: str) -> str:
    """docs/performance.md's GPU table of the log-prob kernels: the check and one row per
    (V_local, path) of `path` (JSON lines of a CUDA run)."""
    rows = [json.loads(line) for line in open(path) if line.strip()]
    check = next((r for r in rows if "check" in r), None)
    out = ["| V_local | path | fwd + bwd | peak extra, % of the logits | bytes moved / time, % of "
           "a device copy |", "|---|---|---|---|---|"]
    for r in rows:
        if "fwd_bwd_s" not in r:
            continue
        frac = f"{r['frac_of_copy']:.0%}" if "frac_of_copy" in r else "-"
        out.append(f"| {r['V_local']} | {r['path']} | {r['fwd_bwd_s'] * 1e3:.2f} ms | "
                   f"{r['peak_extra_pct']:.1f}% | {frac} |")
    first = next(r for r in rows if "fwd_bwd_s" in r)
    verdict = ("not in the file" if check is None else
               f"{check['check']}, {'passed' if check['ok'] else 'FAILED'}")
    out += ["", f"T = {first['T']} tokens, {first['dtype']}, on {first['device']}; V_local = "
                f"V/tp stands for TP = 1, 2, 4 on one device; float64 check: {verdict}."]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--T", type=int, default=None, help="tokens (default 16384 GPU, 2048 CPU)")
    ap.add_argument("--V", type=int, default=None, help="full vocab (151936 GPU, 32768 CPU)")
    ap.add_argument("--tp", default="1,2,4", help="comma-separated TP sizes (V_local = V/tp)")
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--iters", type=int, default=None, help="timed iterations (5 GPU, 2 CPU)")
    ap.add_argument("--out", default=None, help="append the JSON lines to this file too")
    ap.add_argument("--check", action="store_true",
                    help="first compare the kernels with float64 math (exit 1 on mismatch)")
    ap.add_argument("--check-V", default=",".join(map(str, CHECK_V)), metavar="FP32,BF16",
                    help="vocab sizes of the --check cases (default: %(default)s)")
    ap.add_argument("--table", default=None, metavar="JSONL",
                    help="print the markdown table of a CUDA run's rows and exit")
    args = ap.parse_args(argv)
    if print_table(args, table=table):
        return

    device = torch.device(args.device)
    gpu = device.type == "cuda"
    if args.check:
        impl = "triton" if triton_can_run(torch.empty(0, device=device)) else "torch"
        vocabs = tuple(int(x) for x in args.check_V.split(","))
        if not correctness_check(device, impl, args.out, vocabs):
            sys.exit(1)
    t = args.T or (16384 if gpu else 2048)
    v = args.V or (151936 if gpu else 32768)
    iters = args.iters or (5 if gpu else 2)
    dtype = DTYPES[args.dtype]
    copy_bps = copy_bandwidth(device) if gpu else None
    for tp in (int(s) for s in args.tp.split(",")):
        inp = make_inputs(t, v // tp, tp, dtype, device)
        base = inp.pop("logits")
        logits_bytes = base.numel() * base.element_size()
        ref_loss = None
        for path in args.paths.split(","):
            record = dict(path=path, T=t, V_local=v // tp, dtype=args.dtype, TP=tp,
                          device=device.type)
            reason = skip_reason(path, tp, device)
            if reason:
                emit(dict(record, skipped=reason), args.out)
                continue
            res = run_case(path, base, inp, device, iters)
            loss = res.pop("loss")
            if ref_loss is None:
                ref_loss = loss
            if not gpu:  # shared CPU machines: the 1-minute load puts the timings in context
                record["load_avg_1m"] = round(os.getloadavg()[0], 2)
            record.update(res, logits_bytes=logits_bytes,
                          peak_extra_pct=round(100 * res["peak_extra_bytes"] / logits_bytes, 2),
                          loss_max_abs_diff=float((loss - ref_loss).abs().max()))
            if gpu and path.startswith("triton"):
                moved = 3 * logits_bytes
                record.update(achieved_GBps=round(moved / res["fwd_bwd_s"] / 1e9, 1),
                              copy_GBps=round(copy_bps / 1e9, 1),
                              frac_of_copy=round(moved / res["fwd_bwd_s"] / copy_bps, 3))
            emit(record, args.out)


if __name__ == "__main__":
    main()
