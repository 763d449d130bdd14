"""Mixture of experts (Qwen3-MoE, Qwen2-MoE with a gated shared expert and a dense layer) at
every TP x PP x EP layout of 4 ranks, against transformers' own models (tests/hf_tiny.py):
logits, the bitwise HF -> megatron -> HF round trip, and one training step's reduced
gradients (routed experts, router, shared expert, dense) and grad norm against a single-process
float64 gradient. One torchrun launch; see tests/_moe_worker.py."""
import json
import os

import pytest
import torch

from tests._launch import torchrun
from tests.hf_tiny import load_dir, tiny_qwen2_moe, tiny_qwen3_moe
from tests.test_foundation import reference_grads

LAYOUTS = ["tp1_pp1_ep1", "tp2_pp1_ep2", "tp1_pp2_ep2", "tp1_pp1_ep4"]
MODELS = ["qwen3_moe", "qwen2_moe"]
WORKER = os.path.join(os.path.dirname(__file__), "_moe_worker.py")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    work = tmp_path_factory.mktemp("moe")
    models = {"qwen3_moe": tiny_qwen3_moe(work / "qwen3_moe"),
              "qwen2_moe": tiny_qwen2_moe(work / "qwen2_moe")}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (2, 12), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    ref = {"ids": ids, "labels": labels}
    with torch.no_grad():
        ref.update({f"{n}_logits": m(ids).logits for n, m in models.items()})
    torch.save(ref, work / "ref.pt")
    torchrun(WORKER, 4, "--work", str(work))
    grads = {}
    for n, m in models.items():
        g, norm = reference_grads(m, ids, labels)
        grads[n] = per_expert(g), norm
    return work, json.loads((work / "results.json").read_text()), grads


def per_expert(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's 3D expert tensors ([E, 2I, H] gate_up, [E, H, I] down) under the
    checkpoint's per-expert names."""
    out = {}
    for name, g in grads.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base, inter = name[: -len("gate_up_proj")], g.shape[1] // 2
            for e in range(g.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = g[e, :inter]
                out[f"{base}{e}.up_proj.weight"] = g[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(g.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = g[e]
        else:
            out[name] = g
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", MODELS)
def test_moe_logits_match_transformers(run, layout, model):
    _, results, _ = run
    errs = [r["logits_rel_err"] for r in results
            if r["layout"] == layout and r["model"] == model and "logits_rel_err" in r]
    assert errs, f"no logits recorded for {model} at {layout}"
    assert max(errs) <= 1e-5, errs


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", MODELS)
def test_moe_hf_round_trip_bitwise(run, layout, model):
    work, _, _ = run
    src, out = load_dir(work / model), load_dir(work / f"rt_{model}_{layout}")
    assert sorted(src) == sorted(out)
    assert any(".mlp.experts.3.down_proj" in n for n in out)  # every EP rank's experts
    for name, t in src.items():
        assert torch.equal(out[name], t), name


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", MODELS)
def test_moe_reduced_grads_match_single_process(run, layout, model):
    """Expert gradients are reduced over the expert-data-parallel group (DP / EP ranks), dense
    ones over DP, and the experts receive every DP rank's tokens through the all-to-all: a
    wrong scale on either, a router whose top-k softmax differs from HF's, or a missing
    shared-expert gate gradient fails here."""
    work, results, ref = run
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
    assert len(norms) == 1 and norms[0] == pytest.approx(want_norm, rel=1e-5), norms
