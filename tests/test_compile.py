"""compute.compile_layers (megagrpo/compile.py): the compiled layers against the eager ones on a
2-layer model (gradients of every parameter at three micro-batch shapes, a no-grad forward),
one graph for all layers per grad mode with no graph break and no recompile when the shape
changes (tests/_compile_worker.py, one single-rank launch); and the config rules."""
import os
import shutil

import pytest

from megagrpo.config.compile import (
    AUTO_MAX_HIDDEN,
    AUTO_MIN_STEPS,
    auto_reason,
    check_compile,
    compile_layers_on,
)
from megagrpo.config.model import ModelConfig, ParallelConfig
from megagrpo.config.run import ComputeConfig
from tests.support.launch import torchrun_results

WORKER = os.path.join(os.path.dirname(__file__), "_compile_worker.py")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("inductor needs a C++ compiler")
    return torchrun_results(WORKER, 1, tmp_path_factory.mktemp("compile"))[0]


def test_gradients_equal_eager(run):
    """fp32: every parameter's gradient within 1e-6 of the eager layers' (relative to its
    largest entry), at each shape; the no-grad logits too."""
    assert run["layers"] == 2
    for p in run["passes"]:
        assert p["grad_rel_diff"] <= 1e-6, p
    assert run["no_grad_rel_diff"] <= 1e-6, run


def test_one_graph_a_layer_no_breaks_no_recompiles(run):
    """Dynamo broke no graph (each layer's forward is one graph), the first pass made at most
    one graph a layer, new shapes made none (dynamic shapes), the no-grad pass at most one a
    layer."""
    assert run["graph_breaks"] == 0, run["counters"]
    first, *later = [p["new_graphs"] for p in run["passes"]]
    assert 1 <= first <= run["layers"] and later == [0] * len(later), run
    assert 1 <= run["no_grad_new_graphs"] <= run["layers"], run


def test_packed_micro_batches(run):
    """Packed micro-batches (rows end to end, megagrpo's forward_step) of two sizes: gradients
    within 1e-6 of eager, graphs at most two a layer (the packed layout, then a second grid
    size if dynamo specialised the first), no graph break."""
    assert "packed_error" not in run, run.get("packed_error")
    assert len({tuple(g) for g in run["packed_grids"]}) == 2, run["packed_grids"]
    assert run["packed_rel_diff"] <= 1e-6, run
    assert run["packed_new_graphs"] <= 2 * run["layers"], run
    assert run["graph_breaks"] == 0, run["counters"]


def test_switching_between_compiled_and_eager(run):
    """use_compiled (the benchmarks' in-process A/B) switches every compiled layer: off gives
    the eager gradients bit for bit, on again runs the cached graphs (no new one) and agrees
    within 1e-6."""
    assert run["switched_off"] == run["switched_on"] == run["layers"], run
    assert run["switched_eager_bitwise"], run
    assert run["switched_new_graphs"] == 0 and 0 < run["switched_compiled_rel_diff"] <= 1e-6, run


def _dense(hidden: int = 64, **kw) -> ModelConfig:
    return ModelConfig(hidden_size=hidden, ffn_hidden_size=2 * hidden, num_layers=2,
                       num_attention_heads=4, num_query_groups=2, head_dim=16, vocab_size=96,
                       **kw)


def test_auto_rule():
    """auto (the default): on for dense models up to AUTO_MAX_HIDDEN on CPU in runs of
    AUTO_MIN_STEPS steps or more; off when wider, shorter, on CUDA, with LoRA, MoE or TP > 1;
    the console's reason names the limit that left it off."""
    c, par, n = ComputeConfig(), ParallelConfig(), AUTO_MIN_STEPS
    assert c.compile_layers == "auto"
    assert compile_layers_on(c, _dense(AUTO_MAX_HIDDEN), par, lora=False, cuda=False, steps=n)
    assert compile_layers_on(c, _dense(64), par, lora=False, cuda=False, steps=n)
    assert not compile_layers_on(c, _dense(AUTO_MAX_HIDDEN + 64), par, lora=False, cuda=False,
                                 steps=n)
    assert not compile_layers_on(c, _dense(64), par, lora=False, cuda=False, steps=n - 1)
    assert not compile_layers_on(c, _dense(64), par, lora=False, cuda=True, steps=n)
    assert not compile_layers_on(c, _dense(64, dtype="bfloat16"), par, lora=False, cuda=False,
                                 steps=n)
    assert not compile_layers_on(c, _dense(64), par, lora=True, cuda=False, steps=n)
    moe = _dense(64, architecture="qwen3_moe", num_experts=4, moe_ffn_hidden_size=64)
    assert not compile_layers_on(c, moe, par, lora=False, cuda=False, steps=n)
    assert not compile_layers_on(c, _dense(64), ParallelConfig(tp=2), lora=False, cuda=False,
                                 steps=n)
    assert compile_layers_on(ComputeConfig(compile_layers=True), _dense(1024), par, lora=False,
                             cuda=False, steps=1)  # true: wherever it can run
    assert "up to hidden_size 256" in auto_reason(_dense(512), n, cuda=False)
    assert f"= {n - 1})" in auto_reason(_dense(64), n - 1, cuda=False)


def test_bad_settings_refused():
    with pytest.raises(ValueError, match="compute.compile_layers='yes'"):
        ComputeConfig(compile_layers="yes").validate()
    with pytest.raises(ValueError, match="compute.compile_layers=true needs compute.recompute"):
        check_compile(ComputeConfig(compile_layers=True, recompute="full"), _dense(),
                      ParallelConfig(), lora=False)
    with pytest.raises(ValueError, match="lora.enabled=false"):
        check_compile(ComputeConfig(compile_layers=True), _dense(), ParallelConfig(), lora=True)
    check_compile(ComputeConfig(compile_layers=True), _dense(), ParallelConfig(), lora=False)


def test_performance_doc_compiled_table_is_the_results():
    """docs/performance.md's compiled-layers table is layer_split.py --compiled-table on the
    file its marker names."""
    import importlib.util
    from pathlib import Path

    from tests.support.docs import assert_generated_table, between

    root = Path(__file__).resolve().parent.parent
    doc = root / "docs" / "performance.md"
    marker = "<!-- compiled layers table: generated by benchmarks/layer_split.py --compiled-table"
    (path,) = between(doc, marker, "-->").split("--compiled-table", 1)[1].split()
    spec = importlib.util.spec_from_file_location("layer_split",
                                                  root / "benchmarks" / "layer_split.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert_generated_table(doc, marker, "<!-- end of compiled layers table -->",
                           mod.compiled_table(str(root / path)))
