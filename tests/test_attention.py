"""SdpaAttention (megagrpo/parallel/attention.py) against independent references: a float64 naive
softmax attention and megatron's DotProductAttention (module level, fp32 and bf16, GQA, right
padding), transformers' LlamaForCausalLM (whole model, TP=1), and the TP=1 result at TP=2 in real
processes. The shared 2-rank launch (tests/conftest.py) covers the multi-process part; see
tests/_attention_worker.py."""
import json
import os

import pytest
import torch

from megagrpo.config.model import ModelConfig, ParallelConfig
from tests.support.tiny import tiny_llama

WORKER = os.path.join(os.path.dirname(__file__), "_attention_worker.py")
IMPLS = ("SdpaAttention", "DotProductAttention")
# max |a - ref| / max |ref| vs float64: fp32 rounding, and bf16 inputs/outputs (8-bit mantissa)
TOL = {"float32": 1e-6, "bfloat16": 1e-2}


def shared_job(work):
    """This module's part of the shared 2-rank launch (tests/conftest.py): the tiny Llama and
    the batch with transformers' logits under `work`."""
    llama = tiny_llama(work / "llama")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (2, 12), generator=g)
    with torch.no_grad():
        ref = {"ids": ids, "labels": torch.roll(ids, -1, dims=1), "hf_logits": llama(ids).logits}
    torch.save(ref, work / "ref.pt")
    return [WORKER, "--work", str(work)], ref


@pytest.fixture(scope="module")
def run(shared_launch):
    work, ref = shared_launch[__name__]
    results = json.loads((work / "results.json").read_text())
    return results, torch.load(work / "tensors.pt"), ref


def _cases(results, dtype):
    cases = [r for r in results if r["dtype"] == dtype]
    assert len(cases) == 3, results
    return cases


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("impl", IMPLS)
def test_module_matches_float64_reference(run, dtype, impl):
    """Output and input gradients of both modules equal the float64 naive attention
    (GQA 4:2, 4:4, 4:1, right-padded rows with a loss-like upstream gradient)."""
    for r in _cases(run[0], dtype):
        for what in ("out", "dq", "dk", "dv"):
            assert r[f"{impl}_{what}_rel_err"] <= TOL[dtype], (impl, what, r)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_padding_does_not_reach_earlier_positions(run, dtype):
    """Changing q/k/v at the padded positions of a row (>= its length) leaves output and
    gradients at its real positions bit for bit unchanged, with no mask passed: causality."""
    for r in _cases(run[0], dtype):
        assert r["SdpaAttention_pad_max_diff"] == 0.0, r


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rng_state_untouched(run, dtype):
    """Neither module changes the (CPU) RNG state: megatron's p=0 dropout inside its RNG-tracker
    fork draws nothing, so skipping the fork keeps every random stream (resume, TP tests)."""
    for r in _cases(run[0], dtype):
        assert all(r[f"{impl}_rng_unchanged"] for impl in IMPLS), r


def test_model_picks_the_configured_attention(run):
    tensors = run[1]
    assert tensors["tp1_megatron"]["class"] == "DotProductAttention"
    assert tensors["tp1_sdpa"]["class"] == tensors["tp2_sdpa"]["class"] == "SdpaAttention"


@pytest.mark.parametrize("key", ["tp1_sdpa", "tp1_megatron", "tp2_sdpa"])
def test_gpt_logits_match_transformers(run, key):
    _, tensors, ref = run
    got, hf = tensors[key]["logits"], ref["hf_logits"]
    assert ((got - hf).abs().max() / hf.abs().max()).item() <= 1e-5


def test_gpt_gradients_sdpa_equal_megatron(run):
    """A CE loss's gradient of every parameter (TP=1): sdpa == megatron's attention."""
    a, b = run[1]["tp1_sdpa"]["grads"], run[1]["tp1_megatron"]["grads"]
    assert sorted(a) == sorted(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-7, msg=name)


def test_tp2_equals_tp1(run):
    """Logits and the layer-0 attention weight gradients (gathered over the TP shards)."""
    one, two = run[1]["tp1_sdpa"], run[1]["tp2_sdpa"]
    torch.testing.assert_close(two["logits"], one["logits"], rtol=0, atol=1e-5)
    for key in ("qkv_grad", "proj_grad"):
        torch.testing.assert_close(two[key], one[key], rtol=1e-5, atol=1e-7, msg=key)


def test_attention_impl_validated():
    with pytest.raises(ValueError, match="parallel.attention_impl='flash': use auto, sdpa"):
        ParallelConfig(attention_impl="flash").validate(ModelConfig())
    with pytest.raises(ValueError, match="attention_impl='sdpa' replaces the local spec"):
        ParallelConfig(attention_impl="sdpa",
                       transformer_impl="transformer_engine").validate(ModelConfig())


def test_attention_impl_name_on_the_local_spec():
    from megagrpo.model.gpt import attention_impl_name

    assert attention_impl_name(ParallelConfig(transformer_impl="local")) == "sdpa"  # auto
    assert attention_impl_name(ParallelConfig(transformer_impl="local",
                                              attention_impl="megatron")) == "megatron"


def test_dropout_refused_at_construction():
    from megatron.core.transformer.enums import AttnMaskType

    from megagrpo.model.gpt import transformer_config
    from megagrpo.parallel.attention import SdpaAttention

    cfg = transformer_config(ModelConfig(), ParallelConfig())
    cfg.attention_dropout = 0.1
    with pytest.raises(ValueError, match=r"attention_dropout=0.1: .*attention_impl='megatron'"):
        SdpaAttention(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
                      attention_type="self")


def test_benchmark_smallest(tmp_path):
    """benchmarks/attention.py runs at its smallest shape; the two models agree on logits."""
    from tests.test_benchmarks import _run

    (row,) = _run("attention.py", "--shapes", "demo", "--dtypes", "float32", "--iters", "1",
                  "--out", str(tmp_path / "a.jsonl"))
    assert row["max_rel_diff"] < 1e-5
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in row["kernels_sdpa"]
    for impl in ("megatron", "sdpa"):
        assert row[f"step_s_{impl}"] > 0 and 0 < row[f"attn_share_{impl}"]


def test_console_line_names_the_attention():
    from megagrpo.model.gpt import attention_impl_name
    from megagrpo.runtime.console import what_runs

    line = what_runs("local", "auto", attention_impl_name(ParallelConfig(transformer_impl="local")))
    assert line.startswith("layer spec: local") and ", attention: torch sdpa;" in line
    assert "attention" not in what_runs("transformer_engine", "auto", "transformer_engine")
    assert what_runs("local", "auto", "sdpa", True).endswith("; micro-batches: packed end to end")
    assert what_runs("local", "auto", "sdpa", False).endswith("; micro-batches: padded rows")
    # at cp > 1 the SDPA slot runs the CP attention: the line names it, not plain torch sdpa
    cp_line = what_runs("local", "auto", "sdpa", False, cp=2)
    assert ", attention: causal chunks over cp=2 " in cp_line and "torch sdpa" not in cp_line
