"""vocab_parallel_logprob against a float64 log_softmax of the unsharded logits.

Both paths are checked: "triton" runs the real kernels under TRITON_INTERPRET=1 (set by
tests/conftest.py) and "torch" is the chunked pure-torch path. TP=2/4 cases run in real gloo
processes (one spawn per world size shared with test_grpo_loss.py, many cases inside it).
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import megagrpo.kernels.dispatch as dispatch
import megagrpo.kernels.logprob as lp_mod
from megagrpo.kernels import active_path, vocab_parallel_logprob
from tests.kernels.kernels_oracle import (
    assert_close,
    logprob_case,
    oracle_logprob,
    row_scale,
    run_case,
)
from tests.support.dispatch import OpOutputs

IMPLS = ["triton", "torch"]

# name -> (N, V, dtype, temperature, extreme); V values are not multiples of the block size and
# 4100 spans two 4096-wide blocks.
CASES = {
    "fp32": (24, 1000, torch.float32, 1.0, False),
    "bf16_temp": (24, 1000, torch.bfloat16, 0.7, False),
    "fp32_two_blocks": (6, 4100, torch.float32, 1.3, False),
    "extreme_fp32": (12, 777, torch.float32, 1.0, True),
    "extreme_bf16_temp": (12, 777, torch.bfloat16, 0.6, True),
}


def check_logprob(case, out, what):
    logp, ent, grad = oracle_logprob(case["logits"], case["target"], case["temperature"],
                                     case["mask"], case["g"], case["h"])
    scale = row_scale(case)
    assert_close(out["logp"], logp, scale, f"{what} logp")
    assert_close(out["entropy"], ent, scale, f"{what} entropy")
    assert out["grad"].dtype == case["logits"].dtype
    assert_close(out["grad"], grad, scale, f"{what} grad")
    assert (out["grad"][case["mask"]] == 0).all(), f"{what}: ignored rows got a gradient"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", list(CASES))
def test_tp1_matches_float64(name, impl):
    n, v, dtype, temp, extreme = CASES[name]
    case = logprob_case(n, v, 1, dtype, seed=len(name), temperature=temp, extreme=extreme)
    check_logprob(case, run_case(case, impl), f"{name}/{impl}")


@pytest.mark.heavy
@pytest.mark.parametrize("impl", IMPLS)
def test_large_vocab(impl):
    """A realistic vocab shard (Qwen2's 151936 / 4) with many blocks per row (~10 s interpreted)."""
    case = logprob_case(64, 37984, 1, torch.bfloat16, seed=8, temperature=0.9)
    check_logprob(case, run_case(case, impl, inplace=True), f"large/{impl}")


@pytest.mark.parametrize("impl", IMPLS)
def test_without_entropy_and_no_grad(impl):
    case = logprob_case(16, 300, 1, torch.float32, seed=3, temperature=0.8)
    with torch.no_grad():
        logp = vocab_parallel_logprob(case["logits"], case["target"], temperature=0.8,
                                      ignore_mask=case["mask"], impl=impl)
    ref = oracle_logprob(case["logits"], case["target"], 0.8, case["mask"])[0]
    assert_close(logp, ref, row_scale(case), "logp")


@pytest.mark.parametrize("impl", IMPLS)
def test_logp_only_grad_matches(impl):
    case = logprob_case(16, 500, 1, torch.bfloat16, seed=4)
    x = case["logits"].clone().requires_grad_()
    logp = vocab_parallel_logprob(x, case["target"], ignore_mask=case["mask"], impl=impl)
    (logp * case["g"]).sum().backward()
    ref = oracle_logprob(case["logits"], case["target"], 1.0, case["mask"], case["g"],
                         torch.zeros_like(case["h"]))[2]
    assert_close(x.grad, ref, row_scale(case), "grad")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inplace_backward_reuses_logits_and_drops_them(impl, dtype):
    case = logprob_case(16, 600, 1, dtype, seed=5, temperature=0.9)
    leaf = case["logits"].clone().requires_grad_()
    x = leaf * 1  # a non-leaf activation, like the output layer's logits
    seen = []
    x.register_hook(seen.append)
    logp, ent = vocab_parallel_logprob(x, case["target"], temperature=0.9, ignore_mask=case["mask"],
                                       with_entropy=True, inplace_backward=True, impl=impl)
    grad_fn = logp.grad_fn
    (logp * case["g"] + ent * case["h"]).sum().backward()
    assert seen[0].data_ptr() == x.data_ptr(), "gradient was not written into the logits buffer"
    with pytest.raises(RuntimeError):
        grad_fn.saved_tensors  # freed: the Function holds no reference to the stale logits
    ref = oracle_logprob(case["logits"], case["target"], 0.9, case["mask"], case["g"], case["h"])[2]
    assert_close(leaf.grad, ref, row_scale(case), "inplace grad")


@pytest.mark.parametrize("impl", IMPLS)
def test_inplace_backward_flags_other_saved_uses(impl):
    """If something else saved the logits for its backward, overwriting them must not pass
    silently: the version counter is bumped, so that backward raises."""
    case = logprob_case(8, 100, 1, torch.float32, seed=10, masked=False)
    x = case["logits"].clone().requires_grad_() * 1
    z_loss = (x * x).sum()  # saves x; its backward runs after ours
    logp = vocab_parallel_logprob(x, case["target"], inplace_backward=True, impl=impl)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (logp.sum() + z_loss).backward()


def test_inplace_backward_refuses_second_backward():
    case = logprob_case(8, 100, 1, torch.float32, seed=6)
    x = case["logits"].clone().requires_grad_() * 1
    logp = vocab_parallel_logprob(x, case["target"], inplace_backward=True, impl="torch")
    logp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward runs once"):
        logp.sum().backward()


def test_torch_path_is_chunked(monkeypatch):
    """The torch path never creates an fp32 tensor bigger than one chunk of rows."""
    monkeypatch.setattr(lp_mod, "CHUNK_ELEMS", 4 * 256)
    case = logprob_case(32, 256, 1, torch.bfloat16, seed=7, temperature=0.9)
    x = case["logits"].clone().requires_grad_()
    with OpOutputs() as mode:
        logp, ent = vocab_parallel_logprob(x, case["target"], temperature=0.9, with_entropy=True,
                                           ignore_mask=case["mask"], impl="torch")
        (logp * case["g"] + ent * case["h"]).sum().backward()
    assert mode.largest(lambda shape, dtype: dtype == torch.float32) <= 4 * 256
    check_logprob(case, dict(logp=logp, entropy=ent, grad=x.grad), "chunked")


def test_dispatch_logs_the_path_once(monkeypatch, caplog):
    monkeypatch.setattr(dispatch, "_logged", set())
    case = logprob_case(4, 50, 1, torch.float32, seed=9, masked=False)
    with caplog.at_level(logging.INFO, logger="megagrpo.kernels"):
        for _ in range(2):
            for impl in IMPLS:
                vocab_parallel_logprob(case["logits"], case["target"], impl=impl)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and any("triton path" in m for m in lines), lines


def test_dispatch():
    x = torch.zeros(2, 3)
    assert active_path(x) == ("triton" if os.environ.get("TRITON_INTERPRET") == "1" else "torch")
    with pytest.raises(ValueError):
        vocab_parallel_logprob(x, torch.zeros(2, dtype=torch.long), impl="cuda")


# ------------------------------------------------------------------------------ TP over gloo
def test_tensor_parallel_over_gloo(tp_run):
    """Logprob cases of the shared TP=2/TP=4 spawn (see conftest.py)."""
    tp, cases, ranks = tp_run
    for name, case in cases.items():
        if case["kind"] != "logprob":
            continue
        for impl in IMPLS:
            outs = [r[(name, impl)] for r in ranks]
            what = f"tp{tp}/{name}/{impl}"
            assert all(o["collectives"] == 1 for o in outs), f"{what}: not one collective per call"
            same = all(torch.equal(o["logp"], outs[0]["logp"]) for o in outs)
            assert same, f"{what}: ranks differ"
            full = dict(outs[0], grad=torch.cat([o["grad"] for o in outs], dim=1))
            check_logprob(case, full, what)


# Compiles the kernels ahead of time for an H100/H200 (sm_90) down to a cubin: needs no GPU,
# catches what the interpreter lets through (types of loop-carried values, int64 offsets, ...).
AOT_SCRIPT = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import megagrpo.kernels.logprob as L
    common = {"n_cols": "i32", "vocab_start": "i32", "inv_temp": "fp32", "BLOCK_V": "constexpr"}
    for dt in ("*bf16", "*fp32"):
        for flag in (True, False):
            fwd = dict(common, logits_ptr=dt, stride_row="i32", target_ptr="*i64",
                       stats_ptr="*fp32", WITH_ENTROPY="constexpr")
            bwd = dict(common, logits_ptr=dt, stride_row="i32", grad_ptr=dt, grad_stride_row="i32",
                       target_ptr="*i64", max_ptr="*fp32", log_s_ptr="*fp32", shift_ptr="*fp32",
                       g_logp_ptr="*fp32", g_ent_ptr="*fp32", WITH_ENTROPY_GRAD="constexpr")
            for fn, sig, flag_name in ((L._logprob_fwd_kernel, fwd, "WITH_ENTROPY"),
                                       (L._logprob_bwd_kernel, bwd, "WITH_ENTROPY_GRAD")):
                src = ASTSource(fn=fn, signature=sig, constexprs={flag_name: flag, "BLOCK_V": 4096})
                k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
                assert "cubin" in k.asm
    print("compiled")
""")


def test_kernels_compile_for_sm90():
    # the triton wheel of requirements*.txt ships the nvidia backend and its ptxas: a
    # missing one is a broken install and fails here, never skips
    import triton.backends.nvidia  # noqa: F401

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    res = subprocess.run([sys.executable, "-c", AOT_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and "compiled" in res.stdout, res.stderr[-3000:]
