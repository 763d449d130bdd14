"""compute.fused_output_layer wired into megatron (issue 19): the output-layer hook hands the
fused op the hidden states at loss positions and megatron's matmul runs on zero rows; the
shared 4-rank launch (tests/_fused_output_worker.py, last) checks that scoring, three GRPO
variants and the supervised loss give the same log-probs, loss reports and finalized gradients
with the fused layer as with the logits path at TP=2 x PP=2 (tied and untied embeddings) and
TP=2 x DP=2 (tied; padded and packed micro-batches). The op's own numerics against float64 are
tests/kernels/test_fused_output.py."""
import json
import os

import pytest
import torch

from megagrpo.config.train import load_config
from megagrpo.parallel.positions import OutputPositions

WORKER = os.path.join(os.path.dirname(__file__), "_fused_output_worker.py")


class _OutputLayer(torch.nn.Module):
    """Stands in for megatron's ColumnParallelLinear: forward(x [S, b, h], weight=None)."""

    def __init__(self, v: int, h: int, bias: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(v, h))
        self.bias = torch.nn.Parameter(torch.zeros(v)) if bias else None
        self.rows_seen: list[int] = []

    def forward(self, x, weight=None):
        self.rows_seen.append(x.shape[0])
        return x @ (self.weight if weight is None else weight).T, None


def test_hook_hands_over_hidden_states_and_skips_the_matmul():
    layer = _OutputLayer(7, 4)
    sel = OutputPositions(layer)
    hidden = torch.randn(5, 2, 4, requires_grad=True)  # [S, b, h]
    flat = torch.tensor([1, 4, 7])  # (b, s) = (0, 1), (0, 4), (1, 2)
    tied = torch.randn(7, 4)
    with sel.at(flat, 5, fused=True):
        logits, _ = layer(hidden, weight=tied)
    h, w = sel.take_hidden()
    assert logits.shape[0] == 0 and layer.rows_seen == [0]  # no logits computed
    assert w is tied  # the weight megatron passed (tied: the embedding's)
    assert torch.equal(h, torch.stack([hidden[1, 0], hidden[4, 0], hidden[2, 1]]))
    h.sum().backward()
    assert hidden.grad.sum() == 3 * 4  # gradient reaches the decoder through h only
    with sel.at(None, 5, fused=True):  # every position, row-major over [b, S]
        layer(hidden)
    h, w = sel.take_hidden()
    assert torch.equal(h, hidden.transpose(0, 1).reshape(10, 4)) and w is layer.weight
    with pytest.raises(RuntimeError, match="never reached its output layer"):
        sel.take_hidden()
    out, _ = layer(hidden)  # outside `at`: megatron's layer untouched
    assert out.shape == (5, 2, 7)


def test_auto_true_false_and_what_blocks_it():
    plain, biased = OutputPositions(_OutputLayer(7, 4)), OutputPositions(_OutputLayer(7, 4, True))
    assert plain.use_fused("auto") and plain.use_fused(True) and not plain.use_fused(False)
    assert not biased.use_fused("auto") and not biased.use_fused(False)
    with pytest.raises(ValueError, match="compute.fused_output_layer=true.*bias.*=auto or false"):
        biased.use_fused(True)


def test_auto_on_a_gpu_takes_the_logits_path_while_they_fit(caplog):
    """auto on a GPU: the logits path while the micro-batch's logits [n, V_local] take at most
    1/LOGITS_SHARE_GPU of the free memory (it is faster there, docs/performance.md), the fused
    layer beyond; off a GPU (free memory None) always the fused layer. Each choice is named."""
    from megagrpo.parallel import positions

    gib, share = 1 << 30, positions.LOGITS_SHARE_GPU
    v, b = 151936, 2
    fits = (share * v * b * 4096, share * v * b * 4096 - 1)  # exactly 1/share: logits path
    assert positions.auto_output_path(4096, v, b, fits[0])[0] is False
    fused, why = positions.auto_output_path(4096, v, b, fits[1])
    assert fused and "exceed 1/4 of the free" in why and "[4096, 151936]" in why
    assert positions.auto_output_path(4096, v, b, 100 * gib)[0] is False  # 1.16 GiB of 100
    assert positions.auto_output_path(131072, v, b, 100 * gib)[0] is True  # 37 GiB of 100
    assert positions.auto_output_path(10 ** 9, v, b, None)[0] is True  # CPU: unchanged
    sel = OutputPositions(_OutputLayer(7, 4))
    assert positions.free_gpu_bytes(sel.output_weight().device) is None
    positions._SAID.clear()
    with caplog.at_level("INFO", logger="megagrpo"):
        assert sel.use_fused("auto", 10 ** 9) and sel.use_fused("auto", 1)  # CPU weight
    assert [r.getMessage() for r in caplog.records] == [
        "output layer: fused with the loss: hidden states -> loss, no [tokens, vocab] logits"]


def test_config_values():
    assert load_config(None, []).compute.fused_output_layer == "auto"
    for raw, want in (("true", True), ("false", False), ("auto", "auto")):
        cfg = load_config(None, [f"compute.fused_output_layer={raw}"])
        cfg.validate()
        assert cfg.compute.fused_output_layer == want
    cfg = load_config(None, ["compute.fused_output_layer=fast"])
    with pytest.raises(ValueError, match=r"compute.fused_output_layer='fast': use auto, true or"):
        cfg.validate()


def shared_job(work):
    """This module's part of the shared 4-rank launch (tests/conftest.py)."""
    return [WORKER, "--work", str(work)], None


@pytest.fixture(scope="module")
def results(shared_launch):
    work, _ = shared_launch[__name__]
    return json.loads((work / "results.json").read_text())


LAYOUTS = ["tp2_pp2", "tp2_pp2_tied", "tp2_dp2_tied", "tp2_dp2_tied_packed"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fused_equals_logits_path(results, layout):
    rows = [r for r in results if r["layout"] == layout]
    assert len(rows) == 4 and any(r["last_stage"] for r in rows)
    for r in rows:
        where = f"{layout} rank {r['rank']}"
        if r["last_stage"]:  # the fused op ran only when on, once per micro-batch
            assert r["fused_calls"][0] == 0 and r["fused_calls"][1] > 0, r["fused_calls"]
            assert r["rescored_equal"], f"{where}: the logits path is not deterministic"
            assert r["logp_diff"] < 2e-5, f"{where}: scored log-probs {r['logp_diff']}"
            assert r["logp_offmask_zero"]
        want = {"grpo_k3", "gspo", "cispo", "sft"}
        want |= {"bnpo_k1", "dr_grpo_k2", "dapo"} if layout == "tp2_pp2" else set()
        want |= set() if layout.endswith("packed") else {"grpo_k3_all_positions"}
        assert want <= set(r), sorted(r)
        for loss in sorted(want):
            got = r[loss]
            assert got["grad_norm"] > 0, f"{where} {loss}: no gradient"
            assert got["grad_rel"] < 1e-5, f"{where} {loss}: gradients differ {got['grad_rel']}"
            worst = max(got["report_rel"].values(), default=0.0)
            assert worst < 1e-5, f"{where} {loss}: reports differ {got['report_rel']}"
            if r["last_stage"]:  # GSPO recomputes; every token-separable loss: grads in forward
                want_path = "recompute" if loss == "gspo" else "forward_grads"
                other = "forward_grads" if loss == "gspo" else "recompute"
                assert got["paths"][want_path] > 0 and got["paths"][other] == 0, (
                    f"{where} {loss}: {got['paths']}")
