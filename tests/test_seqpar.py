"""Sequence parallelism (parallel.sequence_parallel), activation recomputation
(compute.recompute) and the MoE auxiliary losses at full strength, against single-process
float64 references and the layout without SP. tests/_seqpar_worker.py in the shared 4-rank launch;
the bad-input and helper checks below it need none."""
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from megagrpo.config.model import ModelConfig, ParallelConfig
from megagrpo.config.seqpar import megatron_aux_loss_coeff
from megagrpo.config.train import load_config
from megagrpo.parallel.seqpar import packed_inputs, padded_inputs
from tests._replay_checks import replay_reference
from tests.support.tiny import load_dir, tiny_llama, tiny_qwen3_moe
from tests.test_foundation import (
    PADDED_VOCAB,
    assert_grads_match,
    assert_logits_match,
    reference_grads,
)
from tests.test_moe import per_expert

WORKER = os.path.join(os.path.dirname(__file__), "_seqpar_worker.py")
AUX_COEF, Z_COEF = 0.5, 0.01  # as the worker's
MOE_SLICES = {"moe_tp1": 4, "moe_tp2_ep2_sp": 2, "moe_ep2": 4}  # DP ranks = batch slices
LR, CLIP, ADAM_EPS = 1e-3, 1.0, 1e-4  # the worker's MoE optimizer


def shared_job(work):
    """This module's part of the shared 4-rank launch (tests/conftest.py): the
    tiny models, the batches and the routing-replay reference under `work`."""
    llama = tiny_llama(work / "llama")
    moe = tiny_qwen3_moe(work / "qwen3_moe")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (2, 12), generator=g)
    moe_ids = torch.randint(0, 100, (4, 12), generator=g)
    ref = {"ids": ids, "labels": torch.roll(ids, -1, dims=1), "moe_ids": moe_ids,
           "moe_labels": torch.roll(moe_ids, -1, dims=1)}
    with torch.no_grad():
        ref["llama_logits"] = llama(ids).logits
    torch.save(ref, work / "ref.pt")
    replay_ref = replay_reference(moe, work / "replay.pt")
    return [WORKER, "--work", str(work)], (llama, moe, ids, moe_ids, ref, replay_ref)


@pytest.fixture(scope="module")
def run(shared_launch):
    work, (llama, moe, ids, moe_ids, ref, replay_ref) = shared_launch[__name__]
    results = json.loads((work / "results.json").read_text())
    refs = {"llama": reference_grads(llama, ids, ref["labels"])}
    for layout, slices in MOE_SLICES.items():
        refs[layout] = moe_reference(moe, moe_ids, ref["moe_labels"], slices)
    refs["replay"] = replay_ref
    return work, results, refs


def moe_reference(model, ids, labels, slices: int):
    """Float64 single-process gradients of what the worker trains at a layout whose DP ranks
    hold `slices` equal slices of the batch: the token-mean cross-entropy over the whole
    batch, plus, averaged over the slices, megatron's per-layer load-balancing loss with the
    coefficient converted from HF's (`megatron_aux_loss_coeff`) and the z-loss, computed here
    from HF's router logits in closed form: E * sum_i f_i P_i, f_i = (slice tokens routed to
    expert i over all k slots) / (T k), P_i = the slice's mean softmax probability of expert
    i; z = mean over the slice's tokens of logsumexp(router logits)^2. Returns (HF name ->
    grad with per-expert names, grad norm, mean aux loss per layer and slice, mean z-loss)."""
    import copy

    m = copy.deepcopy(model).double()
    m.config._experts_implementation_internal = "eager"  # grouped_mm has no float64
    cfg = m.config
    k, E = cfg.num_experts_per_tok, cfg.num_experts
    L = sum(1 for layer in m.model.layers if hasattr(layer.mlp, "gate"))
    coef = AUX_COEF * k / L
    router_logits = []
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda mod, a, out: router_logits.append(out[0])) for layer in m.model.layers]
    h = m.model(ids).last_hidden_state
    for hk in hooks:
        hk.remove()
    pad = torch.zeros(PADDED_VOCAB - cfg.vocab_size, h.shape[-1], dtype=h.dtype,
                      requires_grad=True)
    logits = torch.cat([m.lm_head(h), h @ pad.T], dim=-1)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    b, s = ids.shape
    aux_vals, z_vals = [], []
    for lg in router_logits:  # [b*s, E], row-major over (b, s)
        for part in lg.view(b, s, E).chunk(slices, dim=0):
            x = part.reshape(-1, E)
            probs = x.softmax(-1)
            top = probs.topk(k, dim=-1).indices
            f = torch.zeros(E, dtype=x.dtype).index_add_(0, top.flatten(),
                                                         torch.ones(top.numel(), dtype=x.dtype))
            aux = E * (f / (x.shape[0] * k) * probs.mean(0)).sum()
            z = torch.logsumexp(x, dim=-1).square().mean()
            loss = loss + (coef * aux + Z_COEF * z) / slices
            aux_vals.append(float(aux))
            z_vals.append(float(z))
    m.zero_grad()
    loss.backward()
    grads = {n: p.grad for n, p in m.named_parameters()}
    norm = math.sqrt(sum(g.square().sum().item() for g in grads.values())
                     + pad.grad.square().sum().item())
    return per_expert(grads), norm, sum(aux_vals) / len(aux_vals), sum(z_vals) / len(z_vals)


# ------------------------------------------------------------------ dense
def test_sp_logits_and_grads_match_float64(run):
    """TP=2 + SP (megatron's own loss path): logits and reduced gradients and grad norm equal
    the single-process float64 reference within 1e-5 relative (the LayerNorm weights'
    gradients need the TP all-reduce of the sequence-parallel regions)."""
    work, results, refs = run
    native = [r for r in results if "part" not in r]  # check_and_step's records
    assert_logits_match(native, "tp2_sp", "llama")
    assert_grads_match(work, native, refs, "tp2_sp", "llama")


def _dense(results, layout):
    recs = [r for r in results if r.get("part") == "dense" and r["layout"] == layout]
    assert len(recs) == 4, recs
    return recs


RUNS = ["grpo_logits", "grpo_fused", "grpo_all_positions", "gspo_fused", "sft_fused"]


def test_sp_passes_equal_layout_without_sp(run):
    """megagrpo's scoring and update passes (logits path, fused output layer, loss positions
    and every position, GRPO / GSPO / SFT) at TP=2 x DP=2 with SP give every rank's finalized
    gradient shards and the log-probs of the run without SP, on micro-batches of odd width
    (padded to a multiple of tp and cut back before the vocab pass)."""
    for rec in _dense(run[1], "tp2_sp"):
        assert rec["odd_widths"] > 0  # the padding path ran
        assert rec["logp_diff"] <= 1e-5, rec
        for key in RUNS:
            assert rec[key] <= 1e-5, (key, rec)


def test_sp_packed_passes_equal_padded_layout_without_sp(run):
    """Packed micro-batches (rows end to end, T odd: padded to a multiple of tp with tokens of
    no row, split over the TP ranks along T) at TP=2 x DP=2 with SP: the same log-probs and
    finalized gradient shards as the padded run without SP, for every loss and output path."""
    for rec in _dense(run[1], "tp2_sp_packed"):
        assert rec["packed"] > 0 and rec["odd_widths"] > 0  # packed, and SP padded the stream
        assert rec["logp_diff"] <= 1e-5, rec
        for key in RUNS:
            assert rec[key] <= 1e-5, (key, rec)


# Forward calls per micro-batch of the update pass, counted by the worker's hooks on the first
# layer and its core attention: selective recomputes only the core attention in the backward,
# full the whole layer (so its core attention too); none replays nothing.
RECOMPUTED_FORWARDS = {
    "tp2_sp": {"layer": 1, "core_attention": 1},
    "tp2_sp_selective": {"layer": 1, "core_attention": 2},
    "tp2_sp_full": {"layer": 2, "core_attention": 2},
}


@pytest.mark.parametrize("layout", ["tp2_sp_selective", "tp2_sp_full"])
def test_recompute_grads_equal_none(run, layout):
    """compute.recompute selective / full: the same gradients as none (recomputation replays
    the forward exactly: 1e-6 relative), and the recomputation really happened: the hooks
    counted the forwards each mode replays (equal gradients alone pass with recompute off)."""
    for rec in _dense(run[1], layout):
        assert rec["logp_diff"] <= 1e-6, rec
        for key in RUNS:
            assert rec[key] <= 1e-5, (key, rec)
    for name in (layout, "tp2_sp"):
        for rec in _dense(run[1], name):
            assert rec["forwards"] == RECOMPUTED_FORWARDS[name], (name, rec)


# ------------------------------------------------------------------ MoE
def _moe(results, layout):
    recs = [r for r in results if r.get("part") == "moe" and r["layout"] == layout]
    assert len(recs) == 4, recs
    return recs


@pytest.mark.parametrize("layout", list(MOE_SLICES))
def test_moe_grads_with_aux_losses_match_float64(run, layout):
    """Load-balancing and z-loss on, each DP rank its own slice: every reduced gradient (the
    router's carries both losses) and the grad norm equal the float64 reference at TP=1 x
    DP=4 and at TP=2 x EP=2 + SP (where the losses would reach the router at 1/tp without
    SP and an all-to-all returning outputs to the wrong source rank would mix the slices)."""
    work, results, refs = run
    grads, norm, _, _ = refs[layout]
    assert _moe(results, layout)[0]["dp"] == MOE_SLICES[layout]
    recs = [r for r in results if r.get("part") == "moe" and r["rank"] == 0]
    assert_grads_match(work, recs, {"qwen3_moe": (grads, norm)}, layout, "qwen3_moe")
    gate = "model.layers.0.mlp.gate.weight"
    assert gate in grads and grads[gate].abs().max() > 0


@pytest.mark.parametrize("layout", list(MOE_SLICES))
def test_moe_aux_loss_values_closed_form(run, layout):
    """The logged load-balancing loss (megatron's per-layer form, 1 = balanced) and z-loss
    equal the closed form at full strength, and every expert-token pair is counted once:
    tokens per expert = tokens x k / E."""
    _, results, refs = run
    _, _, aux, z = refs[layout]
    for rec in _moe(results, layout):
        m = rec["metrics"]
        assert m["moe_load_balancing_loss"] == pytest.approx(aux, rel=1e-5)
        assert m["moe_z_loss"] == pytest.approx(z, rel=1e-5)
        assert m["moe_tokens_per_expert"] == pytest.approx(4 * 12 * 2 / 4, rel=1e-12)


def test_moe_packed_sp_grads_equal_tp1(run):
    """Packed micro-batches through megagrpo's forward step, load-balancing loss on: at TP=2 x
    EP=2 + SP (a stream of T = 19 padded to 20: the padding token must stay out of the
    attention, the loss and the routers' load-balancing loss) every reduced gradient, the grad
    norm and the logged load-balancing loss equal the TP=1 run's over the same slices."""
    work, results, _ = run
    want = load_dir(work / "grad_qwen3_moe_moe_tp1_packed")
    got = load_dir(work / "grad_qwen3_moe_moe_tp2_ep2_sp_packed")
    assert sorted(got) == sorted(want)
    for name, g in want.items():
        err = (got[name].double() - g.double()).norm() / g.double().norm().clamp_min(1e-30)
        assert err <= 1e-5, (name, float(err))
    assert want["model.layers.0.mlp.gate.weight"].abs().max() > 0
    for a, b in zip(_moe(results, "moe_tp2_ep2_sp_packed"), _moe(results, "moe_tp1_packed")):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
        lb = "moe_load_balancing_loss"
        assert a["metrics"][lb] == pytest.approx(b["metrics"][lb], rel=1e-5)


def test_moe_expert_tokens_not_doubled_by_tp(run):
    """Token rows entering the routed experts, summed over ranks, per (token, slot) and TP
    shard and MoE layer: 1 with SP; tp without it (every TP rank routes every token)."""
    results = run[1]
    tokens_slots = 4 * 12 * 2 * 2  # tokens x k x MoE layers
    for layout, want in (("moe_tp1", 1.0), ("moe_tp2_ep2_sp", 1.0), ("moe_tp2_ep2", 2.0)):
        rec = _moe(results, layout)[0]
        assert rec["expert_rows"] / (tokens_slots * rec["tp"]) == want, (layout, rec)


def adam_first_step(p0: torch.Tensor, grad: torch.Tensor, norm: float) -> torch.Tensor:
    """Float64 weights after one AdamW step (no weight decay) from `p0` with the gradient
    `grad` clipped by the global norm `norm` as megatron clips (max_norm / (norm + 1e-6)): the
    bias-corrected first step is lr * g / (|g| + eps)."""
    g = grad.double() * min(1.0, CLIP / (norm + 1e-6))
    return p0.double() - LR * g / (g.abs() + ADAM_EPS)


@pytest.mark.parametrize("layout", ["moe_ep2_distopt", "moe_ep2"])
def test_moe_distributed_optimizer_with_ep_steps_like_float64(run, layout):
    """TP=1 x EP=2 x DP=4 (aux and z-loss on, each DP rank its own slice): the weights after
    one step of the distributed optimizer (dense Adam state sharded over 4 DP ranks, the
    experts' over their 2 expert-DP ranks, shards all-gathered after the step) and of the plain
    one equal a float64 AdamW step from the single-process gradient and norm, every tensor to
    1e-3 of its step; the distributed optimizer's grad norm is the reference norm."""
    work, results, refs = run
    grads, norm, _, _ = refs["moe_tp1"]  # the same 4 slices
    p0, got = load_dir(work / "qwen3_moe"), load_dir(work / f"step_qwen3_moe_{layout}")
    assert sorted(got) == sorted(p0) == sorted(grads)
    for name, g in grads.items():
        want = adam_first_step(p0[name], g, norm)
        step = (want - p0[name].double()).abs().max().item()
        assert step > 0.1 * LR, f"{name}: the reference step is only {step:.3g}"
        err = (got[name].double() - want).abs().max().item()
        assert err <= 1e-3 * step, f"{name}: max |weight - ref| {err:.3g}, step {step:.3g}"
    (rec,) = [r for r in _moe(results, layout) if r["rank"] == 0]
    assert rec["step_ok"] and rec["grad_norm"] == pytest.approx(norm, rel=1e-5)


def test_moe_distributed_optimizer_with_ep_equals_the_plain_one(run):
    """The same layout and batch with and without the distributed optimizer: the same grad norm
    on every rank and the same weights after the step, to fp32 rounding."""
    work, results, _ = run
    a = load_dir(work / "step_qwen3_moe_moe_ep2_distopt")
    b = load_dir(work / "step_qwen3_moe_moe_ep2")
    gap = max((a[k] - b[k]).abs().max().item() for k in b)
    assert sorted(a) == sorted(b) and gap <= 1e-6, gap
    for ra, rb in zip(_moe(results, "moe_ep2_distopt"), _moe(results, "moe_ep2")):
        assert ra["grad_norm"] == pytest.approx(rb["grad_norm"], rel=1e-6)


# ------------------------------------------------------------------ routing replay
def _replayed(run):
    """(record, global sequence index, row in the record, loss positions, moved position) for
    every sequence the 4 DP ranks scored."""
    _, results, refs = run
    recs = [r for r in results if r.get("part") == "replay"]
    assert len(recs) == 4
    ref = refs["replay"]
    for rec in recs:
        lo, hi = rec["rows"]
        for row, i in enumerate(range(lo, hi)):
            pos = [t for t, on in enumerate(rec["mask"][row]) if on]
            assert pos[0] == ref["prompt_lens"][i] - 1
            yield rec, i, row, pos, ref["moved"][i]


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_routing_replay_routes_as_told(run, layout):
    """The trainer's scoring pass (`Passes.logprobs`, EP=2, each DP rank its own sequences)
    replaying the experts transformers' float64 model chose gives its own log-probs (which
    equal that model's), and replaying routes moved to other experts from one loss position
    of each sequence on gives the float64 log-probs of the same forced routing: unchanged
    before that position, changed (by 2.6e-3 or more here) from it on. A replay that did
    nothing, or put a route on the wrong token (e.g. [B, S] read as [S, B]), fails here,
    unlike in fp32 GRPO runs where vLLM and the trainer already route alike."""
    want = run[2]["replay"]["logp"]
    for rec, i, row, pos, moved in _replayed(run):
        none, own, perm = (rec[f"{r}_{layout}"][row] for r in ("none", "own", "permuted"))
        for t in pos:
            assert none[t] == pytest.approx(want["own"][i][t], abs=1e-5), (i, t)
            assert own[t] == pytest.approx(none[t], abs=1e-6), (i, t)
            assert perm[t] == pytest.approx(want["permuted"][i][t], abs=1e-5), (i, t)
        before = [abs(perm[t] - none[t]) for t in pos if t < moved]
        after = [abs(perm[t] - none[t]) for t in pos if t >= moved]
        assert max(before, default=0.0) <= 1e-6 and max(after) > 1e-3, (i, moved, after)


# ------------------------------------------------------------------ config and helpers
def test_aux_coefficient_converted_from_hf():
    m = ModelConfig(architecture="qwen3_moe", num_experts=8, moe_topk=2, moe_ffn_hidden_size=64,
                    num_layers=6, moe_aux_loss_coef=0.003, moe_dense_layers=[0, 1])
    assert megatron_aux_loss_coeff(m) == pytest.approx(0.003 * 2 / 4)


@pytest.mark.parametrize("overrides, message", [
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel=true needs parallel.tp > 1"),
    (["parallel.sequence_parallel=true", "parallel.tp=2", "parallel.pp=2"],
     "parallel.sequence_parallel=true with parallel.pp=2"),
    (["parallel.sequence_parallel=true", "parallel.tp=2", "algo.routing_replay=true"],
     "algo.routing_replay=true with parallel.sequence_parallel=true"),
    (["compute.recompute=block"], "compute.recompute='block'"),
    (["compute.recompute=full", "compute.recompute_num_layers=3"],
     "compute.recompute_num_layers=3: full recomputation takes 1..2 layers"),
    (["compute.recompute=full", "compute.recompute_num_layers=2", "parallel.pp=2"],
     "compute.recompute_num_layers=2: full recomputation takes 1..1 layers"),
])
def test_bad_settings_refused(overrides, message):
    cfg = load_config(None, overrides)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        cfg.validate()


def test_sequence_parallel_keeps_packed_micro_batches():
    """Packed micro-batches run under sequence parallelism: set both, the config validates and
    the model packs (`megagrpo.model.gpt.sequence_packing`)."""
    from megagrpo.model.gpt import sequence_packing

    cfg = load_config(None, ["parallel.sequence_parallel=true", "parallel.tp=2",
                             "compute.pack_sequences=true"])
    cfg.validate(2)
    assert sequence_packing(cfg.compute, cfg.parallel)


def test_sp_padding():
    ids = torch.arange(1, 11).view(2, 5)
    padded, pos = padded_inputs(ids, 2)
    assert padded.shape == (2, 6) and torch.equal(padded[:, :5], ids)
    assert (padded[:, 5] == 0).all() and torch.equal(pos[0], torch.arange(6))
    assert padded_inputs(ids, 1)[0] is ids


def test_sp_packed_padding():
    """A packed stream of T = 5 tokens at sp = 2: one padding token (id 0, position 0) after
    the last row, flagged in megatron's padding_mask; nothing added where T divides."""
    ids, pos = torch.arange(1, 6)[None], torch.tensor([[0, 1, 2, 0, 1]])
    got_ids, got_pos, kw = packed_inputs(ids, pos, 2)
    assert torch.equal(got_ids, torch.tensor([[1, 2, 3, 4, 5, 0]]))
    assert torch.equal(got_pos, torch.tensor([[0, 1, 2, 0, 1, 0]]))
    assert torch.equal(kw["padding_mask"], torch.tensor([[False] * 5 + [True]]))
    same_ids, same_pos, none = packed_inputs(ids, pos, 5)
    assert same_ids is ids and same_pos is pos and none == {}


def test_sequence_parallel_validates_in_parallel_config():
    ParallelConfig(tp=2, sequence_parallel=True).validate(ModelConfig())


def test_sequence_parallel_auto_rule():
    """parallel.sequence_parallel unset: on for a MoE model at tp > 1 (each TP rank routes its
    own tokens), off for dense models and wherever a setting it does not run with is on (the
    reason names it); set values are kept; the planner counts what the run will do."""
    import dataclasses

    from megagrpo.config.seqpar import resolve_sequence_parallel, sequence_parallel_auto
    from megagrpo.plan import moe_dispatch_bytes

    moe = ["model.architecture=qwen3_moe", "model.num_experts=4", "model.moe_ffn_hidden_size=96"]
    cases = [
        (["parallel.tp=2"], False, "dense model"),
        ([*moe], False, "tp=1"),
        ([*moe, "parallel.tp=2"], True, "a MoE model at tp=2"),
        ([*moe, "parallel.tp=2", "algo.routing_replay=true"], False, "algo.routing_replay=true"),
        ([*moe, "parallel.tp=2", "compute.pack_sequences=true"], True, "a MoE model at tp=2"),
        ([*moe, "parallel.tp=2", "parallel.sequence_parallel=false"], False, "set"),
        (["parallel.tp=2", "parallel.sequence_parallel=true"], True, "set"),
    ]
    for overrides, on, why in cases:
        cfg = load_config(None, overrides)
        got, reason = sequence_parallel_auto(cfg, cfg.model)
        assert got is on and why in reason, (overrides, got, reason)
        parallel, _ = resolve_sequence_parallel(cfg, cfg.model)
        assert parallel.sequence_parallel is on
        dataclasses.replace(cfg, parallel=parallel).validate(4)  # a layout that runs
    auto = load_config(None, [*moe, "parallel.tp=2"])
    explicit = load_config(None, [*moe, "parallel.tp=2", "parallel.sequence_parallel=true"])
    off = load_config(None, [*moe, "parallel.tp=2", "parallel.sequence_parallel=false"])
    assert moe_dispatch_bytes(auto, auto.model, 2, 1) == moe_dispatch_bytes(
        explicit, explicit.model, 2, 1) < moe_dispatch_bytes(off, off.model, 2, 1)
