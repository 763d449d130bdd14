"""Foundation: HF checkpoints loaded into megatron TP/PP shards give transformers' logits; the
HF -> megatron -> HF round trip is bitwise; one training step's reduced gradients and grad norm
equal a single-process float64 reference at every layout, and its Adam step equals TP=1.
tests/_foundation_worker.py covers all layouts in the shared 4-rank launch (tests/conftest.py)."""
import copy
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from tests.support.tiny import load_dir, tiny_llama, tiny_qwen2

LAYOUTS = ["tp1_pp1", "tp2_pp1", "tp1_pp2", "tp2_pp2"]
PADDED_VOCAB = 112  # the worker pads vocab 100 to a multiple of 56 * TP: 112 at TP 1 and 2
WORKER = os.path.join(os.path.dirname(__file__), "_foundation_worker.py")


def shared_job(work):
    """This module's part of the shared 4-rank launch (tests/conftest.py): the
    tiny models and the batch with transformers' logits under `work`."""
    llama = tiny_llama(work / "llama")
    qwen = tiny_qwen2(work / "qwen2")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (2, 12), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    with torch.no_grad():
        ref = {"ids": ids, "labels": labels,
               "llama_logits": llama(ids).logits, "qwen2_logits": qwen(ids).logits}
    torch.save(ref, work / "ref.pt")
    return [WORKER, "--work", str(work)], (llama, qwen, ids, labels)


@pytest.fixture(scope="module")
def run(shared_launch):
    work, (llama, qwen, ids, labels) = shared_launch[__name__]
    grads = {"llama": reference_grads(llama, ids, labels),
             "qwen2": reference_grads(qwen, ids, labels)}
    return work, json.loads((work / "results.json").read_text()), grads


def reference_grads(model, ids, labels, padded_vocab=PADDED_VOCAB):
    """Single-process float64 gradients of the loss the worker trains on: the mean per-token CE
    over the whole batch. megatron's output layer has zero rows for the padded vocab, whose logits
    (0) still enter the softmax: they are modelled by a zero weight `pad` whose gradient counts in
    the norm (its rows are stripped from the HF export). Returns (HF name -> grad, grad norm)."""
    m = copy.deepcopy(model).double()
    if getattr(m.config, "_experts_implementation_internal", None):
        m.config._experts_implementation_internal = "eager"  # grouped_mm has no float64
    m.zero_grad()
    h = m.model(ids).last_hidden_state
    pad = torch.zeros(padded_vocab - m.config.vocab_size, h.shape[-1], dtype=h.dtype,
                      requires_grad=True)
    logits = torch.cat([m.lm_head(h), h @ pad.T], dim=-1)
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    grads = {n: p.grad for n, p in m.named_parameters()}  # a tied weight once
    norm = math.sqrt(sum(g.square().sum().item() for g in grads.values())
                     + pad.grad.square().sum().item())
    return grads, norm


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_logits_match_transformers(run, layout, model):
    assert_logits_match(run[1], layout, model)


def assert_logits_match(results: list[dict], layout: str, model: str) -> None:
    """Every logits comparison the worker recorded for `model` at `layout` (there is one)
    is within 1e-5 relative of transformers'."""
    errs = [r["logits_rel_err"] for r in results
            if r["layout"] == layout and r["model"] == model and "logits_rel_err" in r]
    assert errs, f"no logits recorded for {model} at {layout}"
    assert max(errs) <= 1e-5, errs


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_hf_round_trip_bitwise(run, layout, model):
    work, _, _ = run
    src = load_dir(work / model)
    out = load_dir(work / f"rt_{model}_{layout}")
    if "lm_head.weight" in src and "lm_head.weight" not in out:  # tied: HF may store both
        src.pop("lm_head.weight")
    assert sorted(src) == sorted(out)
    for name, t in src.items():
        assert out[name].dtype == t.dtype and torch.equal(out[name], t), name


def test_exported_dir_loads_in_transformers(run):
    from transformers import AutoModelForCausalLM

    work, _, _ = run
    ref = torch.load(work / "ref.pt")
    m = AutoModelForCausalLM.from_pretrained(work / "rt_qwen2_tp2_pp2").float().eval()
    with torch.no_grad():
        got = m(ref["ids"]).logits
    torch.testing.assert_close(got, ref["qwen2_logits"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_reduced_grads_match_single_process(run, layout, model):
    """The grads megatron DDP hands the optimizer (after the DP all-reduce, the 1/num_microbatches
    scaling and, for tied qwen2 under PP, the embedding all-reduce across stages) and the grad
    norm the optimizer reports equal the float64 single-process gradient. The layouts run DP=4,
    2, 2, 1 on the same batch, so a DP sum instead of a mean, a wrong micro-batch or PP factor, a
    missing tied-embedding reduce or a norm that double-counts TP-replicated norms would fail."""
    assert_grads_match(*run, layout, model)


def assert_grads_match(work, results, ref, layout: str, model: str) -> None:
    """The worker's exported reduced gradients and its grad norm equal the float64 reference
    `ref[model]` = (HF name -> grad, norm), to 1e-5 relative."""
    want, want_norm = ref[model]
    got = load_dir(work / f"grad_{model}_{layout}")
    assert sorted(got) == sorted(want)
    for name, g in want.items():
        err = (got[name].double() - g).abs().max().item()
        scale = g.abs().max().item()
        assert scale > 0, f"{name}: zero reference gradient"
        assert err <= 1e-5 * scale, f"{name}: max |grad - ref| {err:.3g} vs max |ref| {scale:.3g}"
    norms = [r["grad_norm"] for r in results
             if r["layout"] == layout and r["model"] == model and "grad_norm" in r]
    assert len(norms) == 1, norms
    assert norms[0] == pytest.approx(want_norm, rel=1e-5)


@pytest.mark.parametrize("layout", ["tp2_pp1", "tp1_pp2", "tp2_pp2"])
def test_train_step_matches_tp1(run, layout):
    work, results, _ = run
    assert all(r["step_ok"] for r in results if "step_ok" in r)
    base = load_dir(work / "step_llama_tp1_pp1")
    got = load_dir(work / f"step_llama_{layout}")
    init = load_dir(work / "llama")
    changed = 0
    for name, t in base.items():
        torch.testing.assert_close(got[name], t, rtol=0, atol=1e-5, msg=name)
        changed += int(not torch.equal(t, init[name]))
    assert changed == len(base), "every parameter should move after one Adam step"
