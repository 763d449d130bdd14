"""The fused output layer (kernels/fused_output.py) against float64 and the logits path.

TP=1 runs in-process; TP=2 in one spawned gloo pair shared by every TP case (module fixture).
Chunks are tiny (8 tokens x 128 vocab, remainders on both axes) so every case crosses chunk
boundaries; the "triton" path runs under the interpreter on a few cases.
"""
from __future__ import annotations

import logging

import pytest
import torch

from megagrpo.algo import LOSS_AGGREGATIONS, LossCounts, aggregation_weights
from megagrpo.kernels import dispatch, fused_output_grpo_weighted_loss, fused_output_logprob
from megagrpo.kernels import fused_output as fo
from tests.kernels.fused_cases import (
    TOL64,
    TOL_LOGITS,
    GradTol,
    assert_grad_near,
    assert_near,
    check,
    count_fused_paths,
    fused_case,
    grpo_cases,
    reference_grads,
    run_fused,
    run_logits,
    run_weighted,
    tp_worker,
)
from tests.kernels.kernels_oracle import GRPO_OPTIONS
from tests.support.dispatch import CountOps, OpOutputs
from tests.support.launch import spawn_ranks

TP1_GRPO = grpo_cases(1)
LOGPROB = {
    "fp32_t08": fused_case(21, 16, 700, 1, torch.float32, 1, kind="logprob", temperature=0.8),
    "bf16": fused_case(21, 16, 700, 1, torch.bfloat16, 2, kind="logprob", temperature=1.3),
    # one token chunk: bf16 dW written straight from its one product, no fp32 accumulator
    "bf16_one_token_chunk": fused_case(7, 16, 700, 1, torch.bfloat16, 6, kind="logprob"),
    "large_logits": fused_case(12, 16, 500, 1, torch.float32, 3, kind="logprob",
                               logit_scale=300.0),
    "padded": fused_case(19, 8, 512, 1, torch.float32, 4, kind="logprob", pad=100),
}


def _tol(case, table):
    """The table's tolerance; x30 for the large-logit case (|z| ~ 1e3: fp32 rounding of the
    logits themselves is ~1e-4 absolute)."""
    k = 30 if float(case["h"].abs().max() * case["w"].abs().max()) > 50 else 1
    out, grad = table[case["h"].dtype]
    return out * k, GradTol(grad.rtol, grad.atol * k)


@pytest.mark.parametrize("name", list(TP1_GRPO))
def test_grpo_tp1_matches_float64_and_logits_path(name):
    case = TP1_GRPO[name]
    ref, out = reference_grads(case), run_fused(case, "torch")
    check(case, out, ref, TOL64[case["h"].dtype], f"{name} vs float64")
    for key in ("clipped_low", "clipped_high"):
        assert torch.equal(out[key], ref[key]), f"{name}: {key}"
    check(case, out, run_logits(case, "torch"), TOL_LOGITS[case["h"].dtype],
          f"{name} vs logits path")


@pytest.mark.parametrize("name", list(LOGPROB))
def test_logprob_tp1_matches_float64_and_logits_path(name):
    case = LOGPROB[name]
    out = run_fused(case, "torch")
    check(case, out, reference_grads(case), _tol(case, TOL64), f"{name} vs float64")
    check(case, out, run_logits(case, "torch"), _tol(case, TOL_LOGITS), f"{name} vs logits")
    if case["real"] < case["w"].shape[0]:
        assert (out["dw"][case["real"]:] == 0).all(), "padding rows got a gradient"


@pytest.mark.parametrize("name", ["fp32_t08", "bf16"])
def test_triton_path_under_interpreter(name):
    case = LOGPROB[name]
    out, want = run_fused(case, "triton"), run_fused(case, "torch")
    check(case, out, want, TOL_LOGITS[case["h"].dtype], f"{name} triton vs torch")
    check(case, out, reference_grads(case), TOL64[case["h"].dtype], f"{name} triton vs float64")


def test_triton_grpo_under_interpreter():
    case = TP1_GRPO["grpo_kl_k3_clamped"]
    check(case, run_fused(case, "triton"), reference_grads(case), TOL64[case["h"].dtype],
          "triton grpo vs float64")


def test_tied_embedding_gradient_accumulates():
    """Tied: W is also the input embedding; the op's dW adds to the lookup's gradient in the one
    weight's .grad (float64 reference through the same graph, its own loss formula)."""
    case = fused_case(16, 16, 600, 1, torch.float32, 7, options=GRPO_OPTIONS["kl_k2"])
    ids = torch.randint(0, 600, (16,), generator=torch.Generator().manual_seed(3))
    grads = []
    for dtype in (torch.float32, torch.float64):
        w = case["w"].detach().to(dtype, copy=True).requires_grad_()
        h = torch.tanh(w[ids] * 4.0 + case["h"].to(dtype))  # embedding -> a "decoder"
        if dtype == torch.float32:
            loss, _ = fo.fused_output_grpo_loss(
                h, w, case["target"], case["old_logp"], case["advantages"], case["mask"],
                temperature=case["temperature"], impl="torch", chunk_tokens=8, chunk_vocab=128,
                **case["kwargs"])
        else:
            loss = _grpo64_loss(case, h @ w.T)
        (loss * case["g"].to(dtype)).sum().backward()
        grads.append(w.grad)
    assert_near(grads[0], grads[1], 2e-5, "tied dW")


def _grpo64_loss(case, logits64):
    """Per-token k2-KL GRPO loss in float64 on differentiable logits (kl_k2 options)."""
    o = case["kwargs"]
    logsm = torch.log_softmax(logits64 / case["temperature"], dim=-1)
    logp = logsm.gather(1, case["target"][:, None]).squeeze(1)
    m = case["mask"]
    adv = case["advantages"].double()
    old = torch.where(m, case["old_logp"].double(), 0.0)
    r = torch.exp(torch.where(m, logp - old, 0.0))
    pg = -torch.minimum(r * adv, r.clamp(0.8, 1.2) * adv)
    d = logp - o["ref_logp"].double()
    loss = pg + o["beta"] * 0.5 * d * d
    return torch.where(m, loss, 0.0)


def test_no_tokens_by_vocab_tensor_exists():
    """Forward and backward create no logits-like tensor (one without the hidden size H among
    its sizes) bigger than one chunk, chunk_tokens x chunk_vocab, and nothing bigger than the
    weight: neither the T x V logits nor every token against one vocab chunk (T x chunk_vocab,
    16x a chunk here) exist. H = 96 keeps the weight (V x H) 2.7x smaller than the logits."""
    n, hdim, v, tc, vc = 256, 96, 2048, 16, 256
    case = fused_case(n, hdim, v, 1, torch.bfloat16, 8, kind="logprob")
    h = case["h"].clone().requires_grad_()
    w = case["w"].clone().requires_grad_()
    with OpOutputs() as mode:
        logp, ent = fused_output_logprob(h, w, case["target"], ignore_mask=~case["mask"],
                                         with_entropy=True, temperature=case["temperature"],
                                         impl="torch", chunk_tokens=tc, chunk_vocab=vc)
        (logp * case["g"] + ent * case["e"]).sum().backward()
    logits_like = mode.largest(lambda shape, dtype: dtype.is_floating_point and hdim not in shape)
    assert logits_like <= tc * vc < n * vc
    assert mode.largest() <= v * hdim < n * v
    check(case, dict(logp=logp, entropy=ent, dh=h.grad, dw=w.grad), reference_grads(case),
          TOL64[torch.bfloat16], "chunked bf16")


def test_default_chunks_bound_memory(monkeypatch):
    """Default chunks: on the CPU (and on GPU under the old "v1" rules) <= CHUNK_ELEMS logits and
    <= 1/32 of the logits they replace; on GPU ("v2") the same 1/32 but at least
    CHUNK_FLOOR_CUDA and at most CHUNK_ELEMS_CUDA_V2 values, in rows of a multiple of
    CHUNK_ALIGN_CUDA vocab columns (16-byte aligned for cuBLAS) or the whole shard."""
    for rules in ("v1", "v2"):
        monkeypatch.setattr(fo, "CUDA_RULES", rules)
        for t, v, cuda in ((16384, 151936, False), (1024, 151936, False), (256, 151936, False),
                           (16384, 151936, True), (1024, 18992, True), (4096, 151936, True)):
            tc, vc = fo.chunk_shape(t, v, cuda=cuda)
            if cuda and rules == "v2":
                assert tc == min(t, fo.CHUNK_TOKENS_CUDA_V2) and tc * vc <= fo.CHUNK_ELEMS_CUDA_V2
                assert vc % fo.CHUNK_ALIGN_CUDA == 0 or vc == v, (t, v, vc)
                assert tc * vc <= max(t * v / 32, fo.CHUNK_FLOOR_CUDA)
                continue
            assert tc == min(t, fo.CHUNK_TOKENS_CUDA if cuda else fo.CHUNK_TOKENS)
            assert tc * vc <= (fo.CHUNK_ELEMS_CUDA if cuda else fo.CHUNK_ELEMS)
            assert tc * vc <= max(t * v / 32, fo.MIN_CHUNK_ELEMS), (t, v, cuda)  # <= 3%
    assert fo.chunk_shape(5, 100, cuda=False) == (5, 100)
    assert fo.chunk_shape(4096, 151936, cuda=True) == (4096, 16384)  # v2: the 128 MiB floor
    assert fo.chunk_shape(16384, 151936, cuda=True) == (16384, 4736)  # v2: 1/32, aligned
    monkeypatch.setattr(fo, "CUDA_RULES", "v1")
    assert fo.chunk_shape(4096, 151936, cuda=True) == (4096, 4748)  # v1: 9496-byte rows


def test_gpu_gradient_in_forward_rule(monkeypatch):
    """GPU ("v2"): the gradient-in-forward path takes chunks of GRAD_CHUNK_ELEMS_CUDA values and
    runs only with >= GRAD_MIN_TOKENS_CUDA tokens per chunk (or one chunk), bf16 still only from
    T >= 64 H (its fp32 dW); "v1" and the CPU keep 1/32 of the logits and GRAD_MIN_TOKENS."""
    v = 151936
    assert fo.grad_chunk_tokens(16384, v, cuda=True) == fo.GRAD_CHUNK_ELEMS_CUDA // v  # 3533
    assert fo.grad_chunk_tokens(16384, v, cuda=False) == fo.grad_chunk_tokens(16384, v) == 220
    assert fo.use_grad_in_forward(16384, 1024, 1024, 4, cuda=True) is False  # < 2048 tokens
    assert fo.use_grad_in_forward(16384, 2048, 1024, 4, cuda=True) is True
    assert fo.use_grad_in_forward(1000, 1000, 1024, 4, cuda=True) is True  # one chunk
    assert fo.use_grad_in_forward(16384, 3533, 1024, 2, cuda=True) is False  # bf16 T < 64 H
    assert fo.use_grad_in_forward(16384, 220, 1024, 4, cuda=False) is True  # CPU: unchanged
    monkeypatch.setattr(fo, "CUDA_RULES", "v1")
    assert fo.grad_chunk_tokens(16384, v, cuda=True) == 220
    assert fo.use_grad_in_forward(16384, 220, 1024, 4, cuda=True) is True


def test_scoring_without_grad_and_bad_inputs():
    case = LOGPROB["fp32_t08"]
    with torch.no_grad():
        logp = fused_output_logprob(case["h"], case["w"], case["target"],
                                    ignore_mask=~case["mask"], temperature=0.8, impl="torch")
    assert_near(logp, reference_grads(case)["logp"], 2e-5, "no-grad logp")
    assert logp.grad_fn is None
    with pytest.raises(ValueError, match=r"weight \[V_local, H\]"):
        fused_output_logprob(case["h"], case["w"][:, :5], case["target"])
    with pytest.raises(ValueError, match="share a dtype"):
        fused_output_logprob(case["h"], case["w"].bfloat16(), case["target"])
    with pytest.raises(ValueError, match="valid_vocab"):
        fused_output_logprob(case["h"], case["w"], case["target"], valid_vocab=701)


def test_dispatch_logs_the_fused_path_once(monkeypatch, caplog):
    monkeypatch.setattr(dispatch, "_logged", set())
    case = fused_case(4, 8, 64, 1, torch.float32, 9, kind="logprob")
    with caplog.at_level(logging.INFO, logger="megagrpo.kernels"):
        for _ in range(2):
            for impl in ("torch", "triton"):
                fused_output_logprob(case["h"], case["w"], case["target"], impl=impl)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("fused_output_logprob runs the" in m for m in lines), lines


# ------------------------------------------------------------ the gradient computed in the forward
@pytest.fixture
def paths(monkeypatch):
    """Counts of the op's training paths: gradient in the forward, recomputing backward."""
    return count_fused_paths(monkeypatch.setattr)


@pytest.mark.parametrize("name", list(TP1_GRPO))
def test_weighted_loss_tp1_matches_float64(name, paths):
    """sum(g * loss) with its gradient in the forward (GSPO: the recomputing fallback), grad
    output 0.37, 4 token chunks: loss, per-token loss, logp, entropy, dh, dW vs float64."""
    case = TP1_GRPO[name]
    out, ref = run_weighted(case, "torch"), reference_grads(case)
    check(case, out, ref, TOL64[case["h"].dtype], f"{name} weighted vs float64")
    assert_near(out["total"], (ref["loss"] * case["g"].double()).sum(), 2e-5, f"{name} total")
    gspo = case["kwargs"].get("ratio_level") == "sequence"
    assert (paths["recompute"] > 0) == gspo and (paths["forward_grads"] > 0) != gspo, paths


def _closed_form_weights(mode, mask, seq_ids, c: LossCounts) -> torch.Tensor:
    """d aggregate_loss / d token_loss per mode, written out (float64)."""
    m = mask.double()
    if mode in ("grpo", "gspo"):
        per_seq = torch.zeros(int(seq_ids.max()) + 1, dtype=torch.float64).index_add_(
            0, seq_ids, m)
        return m / per_seq[seq_ids].clamp(min=1) / c.num_seqs
    if mode in ("dapo", "cispo"):
        return m / c.num_tokens
    if mode == "bnpo":
        return m / m.sum() / c.num_chunks
    assert mode == "dr_grpo", mode
    return m / (c.num_seqs * c.max_len)


AGG_CASE = {"gspo": "grpo_gspo_sequence", "cispo": "grpo_cispo"}


@pytest.mark.parametrize("mode", sorted(LOSS_AGGREGATIONS))
def test_weighted_loss_each_loss_agg_matches_float64(mode):
    """Each loss_agg: `aggregation_weights` (what megagrpo.train.losses hands the op) against the
    aggregation's closed form, and the op's loss, dh, dW against float64 with those weights."""
    case = TP1_GRPO[AGG_CASE.get(mode, "grpo_kl_k3_clamped")]
    n = case["h"].shape[0]
    seq_ids = torch.arange(n) // 6
    counts = LossCounts(num_tokens=40.0, num_seqs=7.0, max_len=9.0, num_chunks=3)
    tw = aggregation_weights(case["mask"].float(), seq_ids, mode=mode, counts=counts,
                             num_local_seqs=n // 6)
    want = _closed_form_weights(mode, case["mask"], seq_ids, counts)
    assert_near(tw, want, 1e-7, f"{mode} weights")
    ref = reference_grads(dict(case, g=want))
    out = run_weighted(case, "torch", token_weight=tw)
    assert_near(out["total"], (ref["loss"] * want).sum(), 2e-5, f"{mode} loss")
    tol = TOL64[case["h"].dtype][1]
    assert_grad_near(out["dh"], ref["dh"], tol, f"{mode} dh")
    assert_grad_near(out["dw"], ref["dw"], tol, f"{mode} dW")


def test_aggregation_weights_rejects_a_nonlinear_aggregation(monkeypatch):
    import megagrpo.algo as algo

    monkeypatch.setitem(algo.LOSS_AGGREGATIONS, "square", lambda x, m, s, c, n: (x * x).sum())
    with pytest.raises(ValueError, match="not linear"):
        aggregation_weights(torch.ones(4), torch.zeros(4, dtype=torch.long), mode="square",
                            counts=LossCounts(num_tokens=4.0, num_seqs=1.0))


def test_triton_weighted_loss_under_interpreter():
    case = TP1_GRPO["grpo_ppo_dual_clip"]
    check(case, run_weighted(case, "triton"), reference_grads(case), TOL64[case["h"].dtype],
          "triton weighted vs float64")


def test_thin_chunks_take_the_recomputing_path(paths, monkeypatch):
    """Auto: chunks under GRAD_MIN_TOKENS tokens (of more tokens) recompute, wider ones (or a
    single chunk) compute the gradient in the forward; both give the float64 gradients."""
    case = fused_case(40, 8, 512, 1, torch.float32, 11, options=GRPO_OPTIONS["kl_k3_clamped"])
    monkeypatch.setattr(fo, "MIN_CHUNK_ELEMS", 4 * 512)  # 40 * 512 / 32 < 4 * 512: Tc = 4
    ref = reference_grads(case)
    for min_tokens, want in ((8, "recompute"), (4, "forward_grads"), (64, "forward_grads")):
        monkeypatch.setattr(fo, "GRAD_MIN_TOKENS", min_tokens)
        if min_tokens == 64:  # min(T, 64) = 40 tokens > Tc = 4 ... but one chunk of all 40
            monkeypatch.setattr(fo, "MIN_CHUNK_ELEMS", 40 * 512)
        before = dict(paths)
        h, w = case["h"].clone().requires_grad_(), case["w"].clone().requires_grad_()
        loss = fused_output_grpo_weighted_loss(
            h, w, case["target"], case["old_logp"], case["advantages"], case["mask"], case["g"],
            temperature=case["temperature"], impl="torch", **case["kwargs"])[0]
        loss.backward()
        ran = {k: paths[k] - before[k] for k in paths}
        assert ran[want] == 1 and sum(ran.values()) == 1, (min_tokens, ran)
        assert_near(h.grad, ref["dh"], 2e-5, f"{want} dh")
        assert_near(w.grad, ref["dw"], 2e-5, f"{want} dW")


def test_when_the_gradient_is_computed_in_the_forward():
    """fp32: chunks of >= GRAD_MIN_TOKENS tokens (T >= 8192 at 1/32 of a 152k-vocab's logits)
    or one chunk; bf16 also needs its fp32 dW accumulator within 1/32 of the logits (T >= 64 H)."""
    v = 151936
    for t, fp32, bf16 in ((1024, False, False), (4096, False, False), (8192, True, False),
                          (32768, True, False), (65536, True, True), (64, True, True)):
        tc = fo.grad_chunk_tokens(t, v) if t > 64 else t
        assert fo.use_grad_in_forward(t, tc, 1024 if t > 64 else 1, 4) == fp32, t
        assert fo.use_grad_in_forward(t, tc, 1024 if t > 64 else 1, 2) == bf16, t


def test_three_matmuls_with_grad_one_without_and_buffers_freed():
    """4 token chunks: with grad, 3 matmuls per chunk in the forward and none in the backward
    (which frees the saved dh, dW and refuses to run twice); under no_grad one matmul per chunk
    of the forward statistics (no gradient work)."""
    case = TP1_GRPO["grpo_kl_k2"]
    h, w = case["h"].clone().requires_grad_(), case["w"].clone().requires_grad_()
    args = (h, w, case["target"], case["old_logp"], case["advantages"], case["mask"], case["g"])
    kw = dict(case["kwargs"], temperature=case["temperature"], impl="torch", chunk_tokens=5,
              chunk_vocab=case["w"].shape[0], grad_in_forward=True)
    with CountOps() as fwd:
        loss = fused_output_grpo_weighted_loss(*args, **kw)[0]
    assert fwd.n == 3 * 4
    assert all(g is not None for g in loss.grad_fn.grads)
    with CountOps() as bwd:
        (loss * 0.37).backward(retain_graph=True)
    assert bwd.n == 0 and loss.grad_fn.grads is None
    with pytest.raises(RuntimeError, match="backward runs once"):
        loss.backward()
    with torch.no_grad(), CountOps() as scoring:
        total = fused_output_grpo_weighted_loss(*args, **kw)[0]
    assert scoring.n == 4 and total.grad_fn is None
    assert_near(total, loss.detach(), 1e-6, "no-grad loss")


# ------------------------------------------------------------------------------ TP=2 over gloo
TP2_TRITON = ("grpo_ppo_dual_clip", "logprob_bf16")


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fused_tp2")
    cases = dict(grpo_cases(2))
    cases["logprob_fp32"] = fused_case(17, 16, 600, 2, torch.float32, 31, kind="logprob",
                                       temperature=0.7)
    cases["logprob_bf16"] = fused_case(17, 16, 600, 2, torch.bfloat16, 32, kind="logprob")
    # the last shard entirely padding (megatron pads to a multiple of 128 x tp)
    cases["logprob_pad_shard"] = fused_case(11, 8, 512, 2, torch.float32, 33, kind="logprob",
                                            pad=256)
    impls = {name: ("torch", "triton") for name in TP2_TRITON}
    return cases, impls, spawn_ranks(tp_worker, 2, dict(cases=cases, impls=impls), tmp)


def test_tp2_matches_float64_and_logits_path(tp2):
    cases, impls, ranks = tp2
    for name, case in cases.items():
        ref = reference_grads(case)
        logits = [r[(name, "logits")] for r in ranks]
        for impl in impls.get(name, ("torch",)):
            outs = [r[(name, impl)] for r in ranks]
            what = f"tp2/{name}/{impl}"
            for k in ("logp", "entropy", "dh") + (("loss",) if case["kind"] == "grpo" else ()):
                assert torch.equal(outs[0][k], outs[1][k]), f"{what}: ranks differ on {k}"
            full = dict(outs[0], dw=torch.cat([o["dw"] for o in outs]))
            check(case, full, ref, _tol(case, TOL64), f"{what} vs float64")
            want = dict(logits[0], dw=torch.cat([o["dw"] for o in logits]))
            check(case, full, want, _tol(case, TOL_LOGITS), f"{what} vs logits path")
            if case["kind"] != "grpo":
                continue
            outs = [r[(name, "weighted", impl)] for r in ranks]
            assert torch.equal(outs[0]["dh"], outs[1]["dh"]), f"{what}: weighted dh differs"
            full = dict(outs[0], dw=torch.cat([o["dw"] for o in outs]))
            check(case, full, ref, _tol(case, TOL64), f"{what} weighted vs float64")


def test_tp2_collectives(tp2):
    """One all_gather forward and one all_reduce backward per call: as the logits path's
    kernel (all_gather) plus megatron's output layer (input-gradient all_reduce)."""
    cases, impls, ranks = tp2
    for r in ranks:
        assert r["scoring_collectives"] == 1
        for name in cases:
            for impl in impls.get(name, ("torch",)):
                assert r[(name, impl)]["collectives"] == 2, (name, impl)
                if cases[name]["kind"] != "grpo":
                    continue
                # gradient in the forward: one all_gather per token chunk (18 tokens in chunks
                # of 5) + one all_reduce; GSPO's recomputing fallback: one + one
                gspo = cases[name]["kwargs"].get("ratio_level") == "sequence"
                assert r[(name, "weighted", impl)]["collectives"] == (2 if gspo else 4 + 1)
