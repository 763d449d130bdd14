"""Context parallelism (parallel.cp): megagrpo's passes at CP=2 and CP=2 x TP=2 against the
same passes without CP (tests/_cp_worker.py, in the shared 4-rank launch); GRPO runs built by
the run's `setup` at CP=2 against the same run without CP, and the CP=2 checkpoint resumed at
CP=1 and CP=2 (one 2-rank launch, tests/_cp_run_worker.py); the chunk layout, and the
settings refused before compute."""
import json
import os

import pytest
import torch

from megagrpo.config.train import load_config
from megagrpo.parallel.context_parallel import chunk_columns, local_batch, padded_width
from tests._cp_worker import PACKED_DEFECT, PACKED_RUNS, RUNS
from tests.support.launch import run_ranks

WORKER = os.path.join(os.path.dirname(__file__), "_cp_worker.py")
RUN_WORKER = os.path.join(os.path.dirname(__file__), "_cp_run_worker.py")
PAIRS = {"cp2": "ref", "tp2_cp2": "tp2"}  # CP layout: the layout without CP, same shards


def shared_job(work):
    """This module's part of the shared 4-rank launch (tests/conftest.py)."""
    return [WORKER, "--work", str(work)], None


@pytest.fixture(scope="module")
def run(shared_launch):
    work, _ = shared_launch[__name__]
    results = json.loads((work / "results.json").read_text())
    return work, results


def _saved(work, layout: str, rank: int) -> dict:
    return torch.load(work / f"grads_{layout}_{rank}.pt")


def _rel(a: list, b: list) -> float:
    return max(float((x - y).norm() / y.norm().clamp_min(1e-30)) for x, y in zip(a, b))


@pytest.mark.parametrize("layout", list(PAIRS))
def test_cp_gradients_equal_layout_without_cp(run, layout):
    """Every rank's finalized gradients (reduced over DP x CP) of GRPO (sequence mean; logits
    at loss positions and at every position), GSPO (its sequence ratio summed over CP), DAPO
    (token mean) and Dr. GRPO through the fused output layer, and the supervised loss equal
    those of the layout without CP (same TP
    shards) within 1e-5 relative; so do the optimizer's grad norm, the scored log-probs of the
    whole batch (logits path and fused) and the loss reports, made whole over CP. Micro-batch
    widths not divisible by 2 x cp were padded. Packed micro-batches (several rows end to end,
    each row padded to its own 2 x cp chunks) give GRPO's, GSPO's and DAPO's (fused)
    gradients, the scored log-probs and the reports of the padded layout without CP too."""
    work, results = run
    base = PAIRS[layout]
    recs = [r for r in results if r["layout"] == layout]
    assert len(recs) == 4 and all(r["cp"] == 2 for r in recs)
    assert any(w % 4 for r in recs for w in r["widths"]), "no micro-batch needed padding"
    assert all(max(r["packed_rows"]) > 1 for r in recs), "no micro-batch packed two rows"
    for rec in recs:
        rank = rec["rank"]
        mine, ref = _saved(work, layout, rank), _saved(work, base, rank)
        for key in RUNS:
            assert _rel(mine[key], ref[key]) <= 1e-5, (layout, rank, key)
        for key in PACKED_RUNS:
            assert _rel(mine[f"packed_{key}"], ref[key]) <= 1e-5, (layout, rank, "packed", key)
        for key, ref_key in (("logp", "logp"), ("logp_fused", "logp_fused"),
                             ("packed_logp", "logp")):
            torch.testing.assert_close(mine[key], ref[ref_key], rtol=1e-5, atol=1e-5)
    norms = {name: [r["grad_norm"] for r in results if r["layout"] == name]
             for name in (layout, base)}
    assert norms[layout] == pytest.approx(norms[base], rel=1e-5)
    runs = [(key, "reports") for key in RUNS] + [(key, "packed_reports") for key in PACKED_RUNS]
    for key, where in runs:  # reports summed over a layout's replicas (one reporting rank each)
        sums = {}
        for name, field in ((layout, where), (base, "reports")):
            reps = [r[field][key] for r in results if r["layout"] == name
                    and r["rank"] in _reporting_ranks(name, results)]
            sums[name] = {k: sum(rep[k] for rep in reps) for k in reps[0]}
        for k, v in sums[base].items():
            assert sums[layout][k] == pytest.approx(v, rel=1e-5, abs=1e-6), (layout, where, k)


def _reporting_ranks(name: str, results: list) -> set[int]:
    """One rank per DP replica: TP rank 0 and CP rank 0 (TP fastest, then CP)."""
    tp = {"ref": 1, "cp2": 1, "tp2": 2, "tp2_cp2": 2}[name]
    cp = next(r["cp"] for r in results if r["layout"] == name)
    return {r["rank"] for r in results if r["layout"] == name and r["rank"] % (tp * cp) == 0}


@pytest.mark.parametrize("defect", ["full_mask", "chunk_denominators", PACKED_DEFECT])
def test_cp_check_catches_planted_defects(run, defect):
    """The comparison can fail: at CP=2 with the causal mask dropped (keys beyond a query's
    position visible), with a sequence mean over the chunk's tokens instead of the row's, or
    with packed rows attending to the rows before them in the stream (causal over the whole
    packed micro-batch), GRPO's gradients move far from the layout without CP."""
    work, _ = run
    for rank in range(4):
        mine, ref = _saved(work, "cp2", rank), _saved(work, "ref", rank)
        assert _rel(mine[defect], ref["grpo_logits"]) > 1e-2, (defect, rank)


def test_chunk_layout():
    """2 x cp chunks, rank r holding chunks r and 2cp-1-r: together every column once, and
    each rank the same causal work (sum of its positions)."""
    assert padded_width(9, 2) == 12 and padded_width(8, 2) == 8
    cols = [chunk_columns(12, 3, r) for r in range(3)]
    assert torch.equal(cols[0], torch.tensor([0, 1, 10, 11]))
    assert torch.equal(torch.sort(torch.cat(cols)).values, torch.arange(12))
    assert len({int(c.sum()) for c in cols}) == 1
    with pytest.raises(ValueError, match="multiple of 2 x cp"):
        chunk_columns(10, 3, 0)


def test_local_batch_pads_and_keeps_row_lengths():
    from tests._fused_output_worker import make_batch

    b = make_batch(3, 1)
    width = padded_width(b.ids.shape[1], 2)
    parts = [local_batch(b, chunk_columns(width, 2, r), width) for r in range(2)]
    assert sum(int(p.mask.sum()) for p in parts) == int(b.mask.sum())
    assert torch.equal(parts[0].seq_tokens, b.mask.sum(1).float())
    assert parts[1].ids.shape == (b.num_seqs, width // 2)


@pytest.mark.parametrize("overrides, message", [
    (["parallel.cp=0"], "parallel.cp=0 must be >= 1"),
    (["parallel.cp=2", "parallel.pp=2"], "parallel.cp=2 with parallel.pp=2"),
    (["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
     "parallel.cp=2 with parallel.sequence_parallel=true"),
    (["parallel.cp=2", "parallel.attention_impl=megatron"],
     "parallel.cp=2 with parallel.attention_impl='megatron'"),
    (["parallel.cp=2", "parallel.transformer_impl=transformer_engine"],
     "parallel.cp=2 with parallel.transformer_impl='transformer_engine'"),
    (["parallel.cp=2", "algo.loss_agg=bnpo"], "algo.loss_agg='bnpo' with parallel.cp=2"),
    (["parallel.cp=2", "algo.routing_replay=true"], "algo.routing_replay=true with parallel.cp=2"),
    (["parallel.cp=2", "rollout.placement=separate", "rollout.rollout_ranks=1"],
     "rollout.placement='separate' with parallel.cp=2"),
])
def test_bad_settings_refused(overrides, message):
    cfg = load_config(None, overrides)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        cfg.validate()


def test_packing_under_cp_runs_when_set_only():
    """compute.pack_sequences=true is accepted at cp > 1 (`ChunkSplit` cuts each packed row);
    unset, packing stays off under CP (on at cp = 1)."""
    from megagrpo.model.gpt import sequence_packing

    for overrides, packed in [(["parallel.cp=2", "compute.pack_sequences=true"], True),
                              (["parallel.cp=2", "parallel.tp=2"], False), ([], True)]:
        cfg = load_config(None, overrides)
        cfg.validate()
        assert sequence_packing(cfg.compute, cfg.parallel) is packed, overrides


def test_world_must_divide_by_tp_pp_cp():
    cfg = load_config(None, ["parallel.cp=2", "parallel.tp=2", "data.batch_size=4"])
    with pytest.raises(ValueError, match=r"parallel\.tp x parallel\.pp x parallel\.cp = 2 x 1 x 2"):
        cfg.validate(world_size=6)
    cfg.validate(world_size=8)  # DP = 2


@pytest.mark.parametrize("world,k,tp,cp", [(8, 1, 2, 2), (8, 2, 2, 2), (8, 4, 2, 2), (4, 2, 1, 2),
                                           (4, 1, 1, 4), (8, 8, 2, 2), (8, 4, 1, 2)])
def test_rollout_layout_pairs_engines_with_cp_replicas(world, k, tp, cp):
    """Every replica's prompts sampled exactly once by engines of its own ranks (megatron's
    numbering, TP fastest, then CP, then DP, computed here independently), or by the pool when
    an engine spans replicas (k not dividing tp x cp); the feed is shard to shard only when an
    engine is one TP group (k = tp > 1)."""
    from megagrpo.config.layout import RolloutLayout

    dp, B = world // (tp * cp), 5
    lays = [RolloutLayout(rank=r, world_size=world, engine_tp=k, train_tp=tp, train_pp=1,
                          train_cp=cp) for r in range(world)]
    replica = [(r // (tp * cp)) % dp for r in range(world)]
    pooled = (tp * cp) % k != 0 and dp > 1
    assert all(lay.dp == dp and lay.pooled == pooled for lay in lays)
    assert all(lay.shard_to_shard == (k == tp > 1) for lay in lays)
    if pooled:
        engines = {lay.engine: lay.prompt_indices(dp * B) for lay in lays}
        assert sorted(i for idx in engines.values() for i in idx) == list(range(dp * B))
        return
    for d in range(dp):
        members = [lay for lay in lays if replica[lay.rank] == d]
        engines = {lay.engine: lay.prompt_indices(B) for lay in members}
        assert sorted(i for idx in engines.values() for i in idx) == list(range(B))
        assert all({replica[r] for r in lay.engine_ranks()} == {d} for lay in members)


# ---------------------------------------------------------------------- GSPO under CP
def _gspo_inputs(n_rows: int = 3, width: int = 12):
    """Rows of ragged valid tokens with log-probs, old log-probs and advantages [n, width]."""
    g = torch.Generator().manual_seed(11)
    logp = -2.0 + 0.5 * torch.randn(n_rows, width, generator=g)
    old = logp + 0.1 * torch.randn(n_rows, width, generator=g)
    adv = torch.randn(n_rows, 1, generator=g).expand(n_rows, width).contiguous()
    lengths = torch.tensor([11, 4, 8])
    mask = torch.arange(width)[None, :] < lengths[:, None]
    return logp, old, adv, mask


def _gspo_loss(logp, old, adv, mask, seq_len, split=None):
    """GSPO's sequence-mean loss of these tokens [n, w] (each row's tokens over its whole
    length `seq_len` [n]) and its gradient w.r.t. `logp`."""
    from megagrpo.kernels import LossSpec, TokenInputs, loss_from_logp

    x = logp.clone().requires_grad_(True)
    n, w = logp.shape
    ids = torch.arange(n).repeat_interleave(w)
    spec = LossSpec(ratio_level="sequence", eps_low=0.05, eps_high=0.05)
    tok, _ = loss_from_logp(spec, TokenInputs(old.reshape(-1), adv.reshape(-1), mask.reshape(-1),
                                              seq_ids=ids, seq_split=split), x.reshape(-1))
    loss = ((tok.view(n, w) * mask).sum(1) / seq_len).sum() / n
    loss.backward()
    return float(loss.detach()), x.grad


def _gspo_rank(rank, world, rdzv, payload_path, out_dir):
    from megagrpo.kernels import SequenceSplit
    from tests.support.launch import gloo_rank, save_rank

    logp, old, adv, mask = torch.load(payload_path)
    cols = chunk_columns(logp.shape[1], world, rank)
    part = [t[:, cols] for t in (logp, old, adv, mask)]
    seq_len = mask.sum(1).float()
    with gloo_rank(rank, world, rdzv) as group:
        split = _gspo_loss(*part, seq_len, SequenceSplit(group, logp.shape[0]))
        unsplit = _gspo_loss(*part, seq_len)  # the defect: each chunk's own sequence ratio
    save_rank({"cols": cols, "split": split, "unsplit": unsplit}, out_dir, rank)


def test_gspo_sequence_ratio_reduces_over_cp(tmp_path):
    """GSPO's sequence ratio with each row split over 2 CP ranks in load-balanced chunks (the
    log-ratio sums and counts all-reduced, their gradient all-reduced back): the chunks' losses
    add up to the whole rows' loss and each rank's gradient w.r.t. its tokens' log-probs is the
    whole rows' gradient at those columns (1e-6). Without the reduction (each chunk's own
    ratio) the gradient is off: the check can fail. One row's ratio lies beyond the clip
    range (no gradient), two inside."""
    from tests.support.launch import spawn_ranks

    inputs = _gspo_inputs()
    ref_loss, ref_grad = _gspo_loss(*inputs, inputs[3].sum(1).float())
    ranks = spawn_ranks(_gspo_rank, 2, inputs, tmp_path)
    assert sum(r["split"][0] for r in ranks) == pytest.approx(ref_loss, rel=1e-6)
    for r in ranks:
        torch.testing.assert_close(r["split"][1], ref_grad[:, r["cols"]], rtol=1e-6, atol=1e-7)
    off = max(float((r["unsplit"][1] - ref_grad[:, r["cols"]]).abs().max()) for r in ranks)
    assert off > 1e-3 * float(ref_grad.abs().max())


# ---------------------------------------------------------------------- the run at CP=2
# Tolerances. Both layouts run the same fp32 math in another order (chunked attention over
# all-gathered keys, other micro-batches, the gradient summed over CP instead of DP): the
# gradients agree to ~1e-6 relative, so the step records do within 1e-5 (measured <= 2e-7).
# Adam divides each gradient element by its own RMS: an element whose gradient is at the
# rounding noise of its sum moves by a different fraction of lr, so weights are compared
# through each tensor's update, ||dW_cp - dW_ref|| / ||dW_ref|| <= 1e-4 (measured <= 2.1e-5,
# the worst element 5.5e-6 of a 6e-3 move); a checkpoint resumed reruns one step from the same
# weights: 1e-6 (measured 3e-8).
STEP_RTOL, UPDATE_RTOL, RESUME_RTOL = 1e-5, 1e-4, 1e-6


@pytest.fixture(scope="module")
def cp_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("cp_run")
    run_ranks(RUN_WORKER, 2, "--work", str(work))
    ranks = json.loads((work / "results.json").read_text())
    return work, {(rec["run"], rec["rank"]): rec for recs in ranks for rec in recs}


def _params(work, run: str, rank: int) -> dict:
    return torch.load(work / f"params_{run}_{rank}.pt")


def _update_rel(mine: dict, ref: dict) -> float:
    """max over tensors of ||dW_mine - dW_ref|| / ||dW_ref|| (dW: after - before)."""
    return max(float(((mine["after"][k] - mine["before"][k]) - (ref["after"][k] - ref["before"][k]))
                     .norm() / (ref["after"][k] - ref["before"][k]).norm().clamp_min(1e-30))
               for k in ref["after"])


def _same_records(mine: list[dict], ref: list[dict], rtol: float) -> None:
    assert len(mine) == len(ref)
    for a, b in zip(mine, ref):
        assert a["step"] == b["step"] and a["reference_sync"] == b["reference_sync"]
        for k, v in b.items():
            if isinstance(v, float):
                assert a[k] == pytest.approx(v, rel=rtol, abs=1e-7), (a["step"], k)


def _group(rollout: list, prompt: int) -> list:
    return [ids for p, ids in rollout if p == prompt]


def test_cp_run_trains_on_the_rollouts_of_the_run_without_cp(cp_run):
    """The comparison's premise: at CP=2 each rank's engine sampled its share of the replica's
    prompts (prompt r on rank r, gathered over the replica: both CP ranks hold the whole
    batch), and the DP=2 run's replica r sampled the same prompt with the same sampler state,
    so both runs trained on the same completions (and the resumed runs on step 3's)."""
    _, recs = cp_run
    cp = [recs["cp2", r]["rollouts"] for r in (0, 1)]
    assert cp[0] == cp[1] and len(cp[0]) == 3
    for r in (0, 1):
        assert [recs["ref", r]["dp"], recs["cp2", r]["cp"]] == [2, 2]
        for step, batch in enumerate(cp[0]):
            assert len(_group(batch, r)) == 4
            assert _group(recs["ref", r]["rollouts"][step], 0) == _group(batch, r)
        assert _group(recs["resume", r]["rollouts"][0], 0) == _group(cp[0][2], r)
        assert recs["resume_cp2", r]["rollouts"][0] == cp[0][2]


def test_cp_run_equals_the_run_without_cp(cp_run):
    """3 GRPO steps (mu=2 passes: old log-probs scored, the reference's KL in the loss and its
    scheduled reset after step 2, the distributed optimizer) at CP=2 x DP=1 equal the same run
    at CP=1 x DP=2: every step record (loss, KL, entropy, grad norm, ratio, rewards) within
    1e-5 relative and each weight tensor's update within 1e-4; the two CP ranks hold
    bitwise-equal weights."""
    work, recs = cp_run
    for r in (0, 1):
        _same_records(recs["cp2", r]["steps"], recs["ref", r]["steps"], STEP_RTOL)
    assert [s["reference_sync"] for s in recs["cp2", 0]["steps"]] == ["", "steps", ""]
    cp0, cp1, ref = (_params(work, "cp2", 0), _params(work, "cp2", 1),
                     _params(work, "ref", 0))
    assert all(torch.equal(cp0["before"][k], ref["before"][k]) for k in ref["before"])
    assert all(torch.equal(cp0["after"][k], cp1["after"][k]) for k in cp0["after"])
    assert _update_rel(cp0, ref) <= UPDATE_RTOL


@pytest.mark.parametrize("run", ["resume", "resume_cp2"])
def test_cp_checkpoint_resumes_at_cp1_and_cp2(cp_run, run):
    """The CP=2 checkpoint of step 2 (weights, reference, distributed optimizer's moments,
    loader position, reference schedule) resumed at CP=1 x DP=2 and at CP=2: step 3 equals the
    uninterrupted CP=2 run's step 3 and ends at its weights."""
    work, recs = cp_run
    for r in (0, 1):
        _same_records(recs[run, r]["steps"], recs["cp2", r]["steps"][2:], RESUME_RTOL)
    mine, ref = _params(work, run, 0), _params(work, "cp2", 0)
    for k, w in ref["after"].items():
        torch.testing.assert_close(mine["after"][k], w, rtol=RESUME_RTOL, atol=1e-8)


@pytest.mark.parametrize("cp,rank,groups,dtype", [(1, 0, 1, torch.float32),
                                                  (2, 1, 2, torch.float32),
                                                  (3, 1, 4, torch.float32),
                                                  (4, 0, 1, torch.float32),
                                                  (2, 0, 2, torch.bfloat16),
                                                  (2, 1, 2, torch.float64)])
def test_causal_chunk_attention_equals_masked_float64(cp, rank, groups, dtype):
    """The CP attention without a mask (an unmasked block per earlier chunk, SDPA's causal
    square on the diagonal, merged by log-sum-exp; backward through the merged softmax) equals
    float64 attention under the explicit causal mask over the global positions, output and
    the gradients of q, k and v, GQA included (`groups` query heads per KV group); float64
    inputs run in float64 throughout (their log-sum-exps too)."""
    from megagrpo.parallel.context_parallel import causal_chunk_attention

    gen = torch.Generator().manual_seed(cp * 10 + rank)
    b, heads, hn, c = 2, 4, 16, 5
    width = 2 * cp * c
    cols = chunk_columns(width, cp, rank)
    qf, kf, vf = (torch.randn(width, b, h, hn, generator=gen, dtype=torch.float64)
                  for h in (heads, heads // groups, heads // groups))
    leaves = [t.to(dtype).requires_grad_() for t in (qf[cols], kf, vf)]
    out = causal_chunk_attention(*(t.permute(1, 2, 0, 3) for t in leaves),
                                 (rank, 2 * cp - 1 - rank), 0.3)
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    (out.double() * grad).sum().backward()
    refs = [t.detach().clone().requires_grad_() for t in (qf[cols], kf, vf)]
    q, k, v = (t.permute(1, 2, 0, 3) for t in refs)
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2) * 0.3).masked_fill(
        torch.arange(width)[None, :] > cols[:, None], float("-inf"))
    ref = scores.softmax(-1) @ v
    (ref * grad).sum().backward()
    tol = {torch.float64: 1e-12, torch.float32: 1e-6}.get(dtype, 2e-2)
    for mine, theirs in [(out, ref)] + [(a.grad, r.grad) for a, r in zip(leaves, refs)]:
        assert float((mine.double() - theirs).norm() / theirs.norm()) <= tol


@pytest.mark.parametrize("cp,lengths", [(2, [9, 3, 12, 1]), (3, [7, 13, 6])])
def test_packed_chunks_attend_within_their_rows(cp, lengths):
    """Packed rows under CP (`ChunkRows`): each CP rank's chunks of every row end to end. The
    ranks' streams, gathered rank-major and put in `kv_order`, are every row whole (padded to
    2 x cp chunks) in global order; `_CausalChunks` over a rank's blocks equals float64
    attention under the explicit block-diagonal causal mask over the packed rows (output and
    the gradients of q, k and v, GQA), and each token's RoPE position is its column in its
    row."""
    from megagrpo.parallel.context_parallel import ChunkRows, _CausalChunks, row_chunks, row_columns

    gen = torch.Generator().manual_seed(cp)
    chunks = row_chunks(torch.tensor(lengths), cp)
    span = (2 * cp * chunks).tolist()
    total, heads, groups, hn = sum(span), 4, 2, 8
    qf, kf, vf = (torch.randn(total, 1, h, hn, generator=gen, dtype=torch.float64)
                  for h in (heads, heads // groups, heads // groups))
    start = torch.tensor([0] + span).cumsum(0)[:-1]
    rows = [ChunkRows.of_chunks(row_columns(chunks, cp, r, 0), row_columns(chunks, cp, r, 0),
                                chunks, cp, r) for r in range(cp)]
    # each token's place in the global stream (rows end to end, padded)
    where = [start.repeat_interleave(2 * chunks) + rw.position_ids[0] for rw in rows]
    assert torch.equal(torch.sort(torch.cat(where)).values, torch.arange(total))
    gathered = torch.cat([kf[w] for w in where])
    assert torch.equal(gathered[rows[0].kv_order], kf)
    seq = torch.arange(len(span)).repeat_interleave(torch.tensor(span))
    pos = torch.arange(total) - start[seq]
    for r, rw in enumerate(rows):
        leaves = [t.float().requires_grad_() for t in (qf[where[r]], kf, vf)]
        out = _CausalChunks.apply(*(t.permute(1, 2, 0, 3) for t in leaves), rw.blocks, 0.3)
        grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        (out.double() * grad).sum().backward()
        refs = [t.clone().requires_grad_() for t in (qf[where[r]], kf, vf)]
        q, k, v = (t.permute(1, 2, 0, 3) for t in refs)
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        w = where[r]
        visible = (seq[None, :] == seq[w][:, None]) & (pos[None, :] <= pos[w][:, None])
        ref = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~visible, float("-inf")).softmax(-1) @ v
        (ref * grad).sum().backward()
        for mine, theirs in [(out, ref)] + [(a.grad, b.grad) for a, b in zip(leaves, refs)]:
            assert float((mine.double() - theirs).detach().norm() / theirs.norm()) <= 1e-6


def test_cp_refused_before_compute_on_cuda(monkeypatch):
    """On a CUDA machine parallel.cp > 1 would reach torch's CPU flash kernel with CUDA tensors
    mid-run (Transformer Engine's CP is not wired): preflight refuses it, naming the field;
    cp = 1 passes the same check."""
    import torch

    from megagrpo.config.model import ModelConfig
    from megagrpo.config.train import load_config
    from megagrpo.preflight import check_model

    class Vocab:
        vocab_size = 16

    model = ModelConfig(vocab_size=32, hidden_size=64, num_attention_heads=2,
                        num_query_groups=1, head_dim=32)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match=r"parallel\.cp=2 on a CUDA machine.*set parallel\.cp=1"):
        check_model(load_config(None, ["parallel.cp=2"]), model, Vocab())
    check_model(load_config(None, []), model, Vocab())
