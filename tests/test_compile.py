"""compute.compile_layers (megagrpo/model/compile.py): the compiled layers against the eager ones on
a 2-layer model (gradients of every parameter at three micro-batch shapes, a no-grad forward),
one graph for all layers per grad mode with no graph break and no recompile when the shape
changes (tests/_compile_worker.py, one single-rank launch); and the config rules."""
import os
import shutil

import pytest

from megagrpo.config.compile import (
    AUTO_COMPILE_S,
    AUTO_MAX_HIDDEN,
    AUTO_SAVED_S,
    RunWork,
    auto_note,
    auto_reason,
    check_compile,
    compile_layers_on,
    run_work,
)
from megagrpo.config.model import ModelConfig, ParallelConfig
from megagrpo.config.run import ComputeConfig
from tests.support.launch import run_ranks_results

WORKER = os.path.join(os.path.dirname(__file__), "_compile_worker.py")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    if not (shutil.which("g++") or shutil.which("c++")):
        # compute.compile_layers=auto (the default) compiles wherever a compiler is found; CI
        # must have one (scripts/setup_venv.sh refuses to set up without it), so never skip there
        (pytest.fail if os.environ.get("CI") else pytest.skip)("inductor needs a C++ compiler")
    return run_ranks_results(WORKER, 1, tmp_path_factory.mktemp("compile"))[0]


def test_gradients_equal_eager(run):
    """fp32: every parameter's gradient within 1e-6 of the eager layers' (relative to its
    largest entry), at each shape; the no-grad logits too."""
    assert run["layers"] == 2
    for p in run["passes"]:
        assert p["grad_rel_diff"] <= 1e-6, p
    assert run["no_grad_rel_diff"] <= 1e-6, run


@pytest.mark.parametrize("change", ["step", "reset"])
def test_compiled_layers_follow_weights_changed_in_place(run, change):
    """After tracing, an optimizer step and a reference reset (a copy into the weights) change
    the parameters in place: the compiled layers' gradients and no-grad logits still equal the
    eager ones at the new weights within 1e-6 (weights baked in at tracing would not), with no
    new graph."""
    got = run["changed"][change]
    assert got["grad_rel_diff"] <= 1e-6 and got["no_grad_rel_diff"] <= 1e-6, got
    assert got["new_graphs"] == 0, got


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
    """auto (the default): on for dense fp32 models up to AUTO_MAX_HIDDEN on CPU in a run whose
    work would save more than AUTO_COMPILE_S at AUTO_SAVED_S a token pass, layer and unit of
    hidden; off when that work falls short, wider, on CUDA, bf16, with LoRA, MoE or TP > 1; the
    console's reason names the limit that left it off, with the figures it weighed."""
    c, par = ComputeConfig(), ParallelConfig()
    # 2 layers of 64: the break-even is AUTO_COMPILE_S / (2 x 64 x AUTO_SAVED_S) token passes
    even = AUTO_COMPILE_S / (2 * 64 * AUTO_SAVED_S)
    enough, short = RunWork(grpo_steps=100, grpo_step=even / 99), RunWork(grpo_steps=100,
                                                                          grpo_step=even / 101)
    assert c.compile_layers == "auto"
    assert compile_layers_on(c, _dense(64), par, lora=False, cuda=False, work=enough)
    assert not compile_layers_on(c, _dense(64), par, lora=False, cuda=False, work=short)
    # the cold start's passes count too; pipeline stages hold num_layers / pp layers each
    cold = RunWork(grpo_steps=50, grpo_step=even / 101, cold_steps=50, cold_step=even / 99)
    assert compile_layers_on(c, _dense(64), par, lora=False, cuda=False, work=cold)
    assert not compile_layers_on(c, _dense(64), ParallelConfig(pp=2), lora=False, cuda=False,
                                 work=enough)
    wide = RunWork(grpo_steps=10**6, grpo_step=10**6)
    assert compile_layers_on(c, _dense(AUTO_MAX_HIDDEN), par, lora=False, cuda=False, work=wide)
    assert not compile_layers_on(c, _dense(AUTO_MAX_HIDDEN + 64), par, lora=False, cuda=False,
                                 work=wide)
    assert not compile_layers_on(c, _dense(64), par, lora=False, cuda=True, work=wide)
    assert not compile_layers_on(c, _dense(64, dtype="bfloat16"), par, lora=False, cuda=False,
                                 work=wide)
    assert not compile_layers_on(c, _dense(64), par, lora=True, cuda=False, work=wide)
    moe = _dense(64, architecture="qwen3_moe", num_experts=4, moe_ffn_hidden_size=64)
    assert not compile_layers_on(c, moe, par, lora=False, cuda=False, work=wide)
    assert not compile_layers_on(c, _dense(64), ParallelConfig(tp=2), lora=False, cuda=False,
                                 work=wide)
    assert compile_layers_on(ComputeConfig(compile_layers=True), _dense(1024), par, lora=False,
                             cuda=False, work=RunWork(grpo_steps=1, grpo_step=1))  # true: anywhere
    assert "up to hidden_size 256" in auto_reason(_dense(512), par, wide, cuda=False)
    why = auto_reason(_dense(64), par, RunWork(grpo_steps=100, grpo_step=1000.0), cuda=False)
    saved = 100 * 1000 * 2 * 64 * AUTO_SAVED_S
    assert f"~100,000 token passes a layer would save ~{saved:.2g} s against ~21 s" in why
    assert "~2.5 million token passes a layer, ~" in auto_note(
        _dense(64), par, RunWork(grpo_steps=10, grpo_step=2.5e5))


def test_run_work_counts_the_passes_a_config_runs():
    """run_work: sequences per rank x (prompt + rollout.max_tokens, x agent.max_turns when
    multi-turn, capped at rollout.max_model_len) x (the scoring forwards the trainer runs + 3
    per update pass), over run.steps; the cold start's forward + backward over sequences of
    the same length over cold_start.steps."""
    from megagrpo.config.train import TrainConfig

    cfg = TrainConfig()
    cfg.data.batch_size, cfg.algo.group_size, cfg.rollout.max_tokens = 16, 4, 20
    cfg.algo.beta, cfg.algo.mu, cfg.algo.num_minibatches = 0.0, 1, 1
    cfg.run.steps, cfg.cold_start.steps, cfg.cold_start.batch_size = 30, 10, 8
    w = run_work(cfg, 2, 10.0)  # no reference, no old log-probs: the update alone
    assert (w.grpo_steps, w.grpo_step, w.cold_steps, w.cold_step) == (
        30, 32 * 30 * 3, 10, 4 * 30 * 3)
    assert w.tokens == 30 * 32 * 30 * 3 + 10 * 4 * 30 * 3
    cfg.algo.beta = 0.04  # + the reference's forward
    assert run_work(cfg, 2, 10.0).grpo_step == 32 * 30 * 4
    cfg.algo.mu = 2  # + the old log-probs' forward, and two updates
    assert run_work(cfg, 2, 10.0).grpo_step == 32 * 30 * (2 + 6)
    cfg.algo.mu, cfg.agent.environment, cfg.agent.max_turns = 1, "tools", 3
    cfg.rollout.max_model_len = 50  # 10 + 3 turns x 20 capped at 50
    assert run_work(cfg, 2, 10.0).grpo_step == 32 * 50 * 4



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
