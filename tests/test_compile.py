"""compute.compile_layers (megagrpo/compile.py): the compiled layers against the eager ones on a
2-layer model (gradients of every parameter at three micro-batch shapes, a no-grad forward),
one graph for all layers per grad mode with no graph break and no recompile when the shape
changes (tests/_compile_worker.py, one single-rank launch); and the config rules."""
import os
import shutil

import pytest

from megagrpo.config.compile import AUTO_MIN_HIDDEN, check_compile, compile_layers_on
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


def _dense(hidden: int = 64, **kw) -> ModelConfig:
    return ModelConfig(hidden_size=hidden, ffn_hidden_size=2 * hidden, num_layers=2,
                       num_attention_heads=4, num_query_groups=2, head_dim=16, vocab_size=96,
                       **kw)


def test_auto_rule():
    """auto: on for dense models from AUTO_MIN_HIDDEN on CPU, off below, on CUDA, with LoRA."""
    c, par = ComputeConfig(compile_layers="auto"), ParallelConfig()
    assert compile_layers_on(c, _dense(AUTO_MIN_HIDDEN), par, lora=False, cuda=False)
    assert not compile_layers_on(c, _dense(AUTO_MIN_HIDDEN // 2), par, lora=False, cuda=False)
    assert not compile_layers_on(c, _dense(AUTO_MIN_HIDDEN), par, lora=False, cuda=True)
    assert not compile_layers_on(c, _dense(AUTO_MIN_HIDDEN), par, lora=True, cuda=False)
    assert not compile_layers_on(ComputeConfig(), _dense(AUTO_MIN_HIDDEN), par, lora=False,
                                 cuda=False)  # the default: off


def test_bad_settings_refused():
    with pytest.raises(ValueError, match="compute.compile_layers='yes'"):
        ComputeConfig(compile_layers="yes").validate()
    with pytest.raises(ValueError, match="compute.compile_layers=true needs compute.recompute"):
        check_compile(ComputeConfig(compile_layers=True, recompute="full"), _dense(),
                      ParallelConfig(), lora=False)
    with pytest.raises(ValueError, match="lora.enabled=false"):
        check_compile(ComputeConfig(compile_layers=True), _dense(), ParallelConfig(), lora=True)
    check_compile(ComputeConfig(compile_layers=True), _dense(), ParallelConfig(), lora=False)
