"""benchmarks/dtype_demo.py: the demo in fp32, bf16 and fp16 as one table. On synthetic runs
the row is written out by hand (held-out accuracies, the gap, the fp16 scaler's figures, the
minutes); docs/performance.md holds exactly the table of the committed runs."""
import json

from tests.support.docs import assert_generated_table
from tests.test_benchmarks import ROOT, _bench_module


def _run(dtype: str, **kw) -> dict:
    return {"dtype": dtype, "tag": "t", "cpu": "CPU X", "rc": 0, "wall_seconds_command": 125.4,
            "load_mean": 3.04, "grpo_steps": 100, "evals": {"0": 0.3, "50": 0.5, "100": 0.625},
            "summary": {"eval_accuracy_init": 0.0, "eval_accuracy_before": 0.3125},
            "reward_first10": 0.31, "reward_last10": 0.6049, "gap_mean": 1.234e-3,
            "gap_max": 0.0456, **kw}


def test_table_rows_in_dtype_order(tmp_path):
    bench = _bench_module("dtype_demo")
    fp16 = _run("float16", loss_scale_overflows=3.0, loss_scale_last=32768.0, rc="timeout",
                wall_seconds_command=720.0)
    for name, run in (("a", fp16), ("b", _run("float32")), ("c", _run("bfloat16"))):
        (tmp_path / f"{name}.json").write_text(json.dumps(run))
    lines = bench.table(tmp_path).splitlines()
    assert lines[2:] == [
        "| CPU X | fp32 | 0.000 -> 0.312 -> 0.625 (step 100) | 100 | 0.310 / 0.605 | "
        "0.0012 (0.046) | - | 2 min 05 s (3.0) |",
        "| CPU X | bf16 | 0.000 -> 0.312 -> 0.625 (step 100) | 100 | 0.310 / 0.605 | "
        "0.0012 (0.046) | - | 2 min 05 s (3.0) |",
        "| CPU X | fp16 | 0.000 -> 0.312 -> 0.625 (step 100) | 100 (rc timeout) | 0.310 / "
        "0.605 | 0.0012 (0.046) | 3, 32768 | 12 min 00 s (3.0) |"]


def test_performance_doc_holds_the_generated_table():
    assert_generated_table(ROOT / "docs" / "performance.md", "<!-- dtype-demo:start",
                           "<!-- dtype-demo:end", _bench_module("dtype_demo").table())
