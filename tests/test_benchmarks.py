"""Smoke tests: every script in benchmarks/ runs end to end at its smallest size with one
repeat and prints figures that are sane, so no benchmark can rot unseen. These check that the
scripts work and that their built-in correctness checks pass, never how fast anything is."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


def _run(script: str, *args: str, python: str = sys.executable, timeout: int = 600,
         env: dict | None = None) -> list[dict]:
    """Runs benchmarks/<script> from the repo root; returns the JSON lines it printed."""
    env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    p = subprocess.run([python, str(BENCH / script), *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{script} failed (rc={p.returncode}):\n{p.stderr[-4000:]}"
    rows = [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert rows, f"{script} printed no JSON line:\n{p.stdout[-2000:]}"
    return rows


def test_kernels_benchmark_smallest(tmp_path):
    out = tmp_path / "k.jsonl"
    rows = _run("kernels.py", "--device", "cpu", "--check", "--T", "64", "--V", "512",
                "--tp", "1", "--iters", "1", "--out", str(out))
    checks = [r for r in rows if "check" in r]
    assert checks and all(r["ok"] for r in checks)  # kernels vs float64
    cases = [r for r in rows if "path" in r and "skipped" not in r]
    assert cases and all(r["fwd_bwd_s"] > 0 and r["loss_max_abs_diff"] < 1e-3 for r in cases)


def test_hf_logits_benchmark(tmp_path):
    rows = _run("hf_logits.py", "--out", str(tmp_path / "h.jsonl"))
    assert {(r["model"], r["dtype"]) for r in rows} == {
        ("llama", "float32"), ("llama", "bfloat16"), ("qwen2", "float32"), ("qwen2", "bfloat16")}
    for r in rows:
        assert r["max_rel_err"] < (1e-5 if r["dtype"] == "float32" else 5e-2), r


def test_weight_sync_benchmark_tiny(tmp_path):
    out = tmp_path / "w.jsonl"
    (row,) = _run("weight_sync.py", "--sizes", "tiny", "--repeats", "1", "--out", str(out))
    assert row["greedy_agrees_with_hf"] and row["max_logprob_gap"] < 1e-4
    assert row["sync_s"] > 0 and row["disk_total_s"] > 0 and row["bytes"] > 0
    assert out.read_text().strip() == json.dumps(row)


def test_weight_sync_benchmark_vllm_tp2_tiny(tmp_path):
    """The vLLM TP=2 rows (2 ranks under torchrun): the shard-to-shard feed receives less than
    the full-tensor one, and the engine it fed decodes like HF."""
    (row,) = _run("weight_sync.py", "--vllm-tp", "2", "--sizes", "tiny", "--repeats", "1",
                  "--out", str(tmp_path / "w2.jsonl"))
    assert row["greedy_agrees_with_hf"] and row["max_logprob_gap"] < 1e-4
    assert 0 < row["slices_received_bytes"] < row["full_received_bytes"]
    assert row["slices_s"] > 0 and row["disk_total_s"] > 0


def test_reference_sync_benchmark_tiny(tmp_path):
    (row,) = _run("reference_sync.py", "--sizes", "tiny", "--tps", "1", "--repeats", "1",
                  "--out", str(tmp_path / "r.jsonl"))
    assert row["inplace_a1_s"] > 0 and row["params"] > 0


def test_grpo_step_benchmark_one_rank_one_step(tmp_path):
    (row,) = _run("grpo_step.py", "--nprocs", "1", "--warmup", "0", "--steps", "1",
                  "--out", str(tmp_path / "g.jsonl"), timeout=900)
    assert row["gen_tokens_per_s"] > 0 and row["nproc"] == 1


TRL_PY = ROOT / ".venv-trl" / "bin" / "python"


@pytest.mark.skipif(not TRL_PY.exists(), reason="TRL lives in its own venv: run "
                    "`bash scripts/setup_trl_venv.sh` to include the TRL baseline's smoke test")
def test_trl_baseline_one_step(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    (row,) = _run("trl_grpo_baseline.py", "--warmup", "0", "--steps", "1", "--threads", "1",
                  "--out", str(tmp_path / "t.jsonl"), python=str(TRL_PY), timeout=900, env=env)
    assert row["gen_tokens_per_s"] > 0
