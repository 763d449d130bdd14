"""Smoke tests: every script in benchmarks/ runs end to end at its smallest size with one
repeat and prints figures that are sane, so no benchmark can rot unseen. These check that the
scripts work and that their built-in correctness checks pass, never how fast anything is."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


def test_fused_output_benchmark_smallest(tmp_path, capsys):
    """The fused output layer benchmark at a toy size (TP=1 and the 2-rank TP=2), one repeat:
    its float64 check passes, every path gives the same loss, and a size over the memory budget
    is a row that says so."""
    out = tmp_path / "f.jsonl"
    rows = _run("fused_output.py", "--check", "--H", "32", "--V", "1024", "--T", "64",
                "--tp", "1,2", "--iters", "1", "--out", str(out),
                "--paths", "logits,fused_forward,fused_recompute,fused,naive")
    assert [r["ok"] for r in rows if "check" in r] == [True]
    done = [r for r in rows if "fwd_bwd_s" in r]
    fused = ("fused_forward", "fused_recompute", "fused")
    assert {(r["TP"], r["path"]) for r in done} == {
        (tp, p) for tp in (1, 2) for p in ("logits",) + fused} | {(1, "naive")}
    assert {r["fused_grad"] for r in done if r["path"] == "fused"} == {"forward"}  # one chunk
    assert all(r["fwd_bwd_s"] > 0 and r["loss_max_rel_diff"] < 1e-5 for r in done), done
    table = _bench_module("fused_output").table(str(out)).splitlines()
    assert len(table) == 2 + 2 and all(ln.count("|") == 14 for ln in table)  # TP 1 and 2
    assert "x |" in table[2] and "n/a" in table[3]  # ratios; TP=2 has no naive row
    capsys.readouterr()  # in-process: only the refusal is exercised, nothing is allocated
    _bench_module("fused_output").main(["--H", "32", "--V", "1024", "--T", "4096", "--tp", "1",
                                         "--paths", "naive,fused_forward", "--mem-gib", "0.01"])
    big = [json.loads(ln) for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
    assert {r["path"] for r in big} == {"naive", "fused_forward"}
    assert all("budget" in r["skipped"] for r in big)


def test_performance_doc_fused_output_table_is_the_results_table():
    """docs/performance.md's fused output table is the one fused_output.py --table makes from
    benchmarks/results/fused_output_cpu.jsonl (figures are generated, never typed in)."""
    mod, results = _bench_module("fused_output"), BENCH / "results"
    doc = (ROOT / "docs" / "performance.md").read_text()
    assert mod.table(str(results / "fused_output_cpu.jsonl")) in doc
    assert mod.fit_table(str(results / "fused_output_fit_cpu.jsonl")) in doc


def test_fused_output_step_fit_smallest():
    """--fit-gib at 2 layers of SmolLM2-135M's shapes: the logits path's extra bytes per token
    exceed the fused layer's by about the fp32 logits row it holds (V x 4 bytes per completion
    token), so the fused layer fits more tokens, and the pass run at the fitted size stays
    within the budget."""
    budget = 0.5 * 2**30
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the step: torch
    rows = _run("fused_output.py", "--fit-gib", "0.5", "--fit-layers", "2", "--fit-verify",
                env=env)
    by = {r["path"]: r for r in rows if "fit" in r}
    assert set(by) == {"logits", "fused"}, rows
    logits_row = 49152 * 4 * 448 / 512  # per token of a 64 + 448-token sequence
    gap = by["logits"]["bytes_per_token"] - by["fused"]["bytes_per_token"]
    assert 0.9 * logits_row < gap < 1.2 * logits_row, (gap, logits_row)
    assert by["fused"]["max_tokens"] > 1.5 * by["logits"]["max_tokens"]
    assert by["fused"]["tokens_vs_logits_path"] > 1.5
    for r in by.values():
        assert 0.6 * budget < r["verified_peak_bytes"] <= 1.02 * budget, r


@pytest.mark.parametrize("method", ["allocator", "rss"])
def test_harness_cpu_peak_counts_a_temporary(method):
    """The CPU peak of a call that fills and frees a 64 MiB temporary and returns a 16 MiB
    tensor is about 80 MiB by either method (the rss one also counts glibc's slack); a wrong
    baseline or an unreset high-water mark would be off by the 64 MiB or by what ran before."""
    sys.path.insert(0, str(BENCH))
    from _harness import peak_extra_bytes
    mib = 1 << 20
    ballast = torch.ones(256 * mib // 4)  # RSS before the call: must not count
    del ballast

    def call():
        tmp = torch.ones(64 * mib // 4)
        out = torch.full((16 * mib // 4,), float(tmp[0]))
        del tmp
        return out

    peak = peak_extra_bytes(call, torch.device("cpu"), method=method)
    assert 78 * mib <= peak <= (82 if method == "allocator" else 100) * mib, peak / mib


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
    # the benchmark's own correctness fields: the reference afterwards equals the policy (alpha=1,
    # reload) exactly, or lerp(ref, policy, 0.5) to float32 rounding (the norms are ~1: an ulp
    # is ~1e-7); no parameter's storage is replaced; the in-place syncs allocate no copy of the
    # model (a clone-based sync would show a peak of about local_bytes)
    assert row["inplace_a1_max_diff"] == 0 and row["reload_max_diff"] == 0, row
    assert row["inplace_a05_max_diff"] <= 1e-6, row
    assert all(row[f"{k}_storage_same"] for k in ("inplace_a1", "inplace_a05", "reload")), row
    model_mb = row["local_bytes"] / 2**20
    assert row["inplace_a1_peak_extra_mb"] < model_mb / 4, row
    assert row["inplace_a05_peak_extra_mb"] < model_mb / 4, row


def _bench_module(name: str):
    """A benchmarks/ module imported by file path (benchmarks/ is not a package)."""
    import importlib.util

    sys.path.insert(0, str(BENCH))  # grpo_step imports _workloads as a sibling
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses resolve annotations through sys.modules
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))


def _flop_pair():
    """The same tiny Llama as megagrpo's ModelConfig and as an eager-attention HF model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megagrpo.config.model import ModelConfig

    mc = ModelConfig(vocab_size=40, hidden_size=64, ffn_hidden_size=96, num_layers=2,
                     num_attention_heads=4, num_query_groups=2, head_dim=32)
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=40, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        attn_implementation="eager")).eval()
    return mc, hf


def test_forward_flops_match_torch_flop_counter():
    """The useful-FLOP model (dense layers, causal attention, output layer at the loss
    positions) against torch's FlopCounterMode on a real HF Llama forward (eager attention,
    logits at every position): they differ exactly by the causal half of attention,
    2 L d n (n - 1), and by the output layer at the n - k positions without a loss."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    W = _bench_module("_workloads")
    mc, hf = _flop_pair()
    n, k = 11, 4
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        hf(torch.randint(0, 40, (1, n)))
    d = mc.num_attention_heads * mc.head_dim
    expected = (fc.get_total_flops() - 2 * mc.num_layers * d * n * (n - 1)
                - 2 * mc.hidden_size * mc.vocab_size * (n - k))
    assert W.forward_flops(mc, torch.tensor([n]), k) == expected


def test_rollout_flops_match_torch_flop_counter_on_kv_cache_decode():
    """The rollout's useful FLOPs (each prompt prefilled once, one forward per sampled token
    but the last, logits at every sampled position) against FlopCounterMode on what a sampler
    does: an HF Llama prefills the prompt (logits at its last position only), then decodes each
    sample from a copy of that KV cache one token at a time. They differ exactly by the
    prefill's non-causal half of attention, 2 L d p (p - 1)."""
    import copy

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    W = _bench_module("_workloads")
    mc, hf = _flop_pair()
    p, comps = 7, [5, 1, 3]
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        cache = hf(torch.randint(0, 40, (1, p)), use_cache=True, logits_to_keep=1).past_key_values
        for c in comps:
            kv = copy.deepcopy(cache)
            for _ in range(c - 1):
                kv = hf(torch.tensor([[5]]), past_key_values=kv, use_cache=True).past_key_values
    d = mc.num_attention_heads * mc.head_dim
    expected = fc.get_total_flops() - 2 * mc.num_layers * d * p * (p - 1)
    assert W.rollout_flops(mc, [p], [comps]) == expected


def test_row_lengths_pad_equal_to_eos():
    """Real tokens per row when pad == EOS (SmolLM2): a completion's final EOS and an EOS id
    inside a chat prompt both count; trailing pad does not."""
    import torch

    g = _bench_module("grpo_step")
    pad = 2
    ids = torch.tensor([[5, 2, 6, 7, 2, 2, 2],    # prompt [5, 2, 6], completion [7, EOS]
                        [5, 6, 8, 9, 4, 2, 2],    # prompt [5, 6], completion [8, 9, 4]
                        [2, 2, 2, 2, 2, 2, 2]])   # a padding row
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[0, 2:4] = True  # targets 7 and EOS
    mask[1, 1:4] = True
    assert g.row_lengths(ids, mask, pad).tolist() == [5, 5, 0]


def test_grpo_step_benchmark_one_rank_one_step(tmp_path):
    """demo at 1 rank: the new fields are present and sane, and they agree with each other:
    every completion token carries the loss; the update's real tokens are the completions plus
    prompts of 2-digit additions (BOS + 4..6 characters); scoring ran the old log-probs' pass
    only (the workload resets the reference every step, so it equals the policy and its pass is
    reused: compute.reuse_equal_reference), so its FLOPs are 1/3 of the update's (3 x one
    forward)."""
    (row,) = _run("grpo_step.py", "--workload", "demo", "--nprocs", "1", "--warmup", "1",
                  "--steps", "1", "--set", "data.batch_size=8", "--out", str(tmp_path / "g.jsonl"),
                  timeout=900)
    assert row["gen_tokens_per_s"] > 0 and row["nproc"] == 1 and row["workload"] == "demo"
    assert 0 <= row["padded_token_share"] < 1 and row["gemm_gflops"] > 0
    assert 0 < row["mfu_update"] < 1.5 and 0 < row["mfu_score"] < 1.5
    assert row["padded_token_share"] == round(
        1 - row["real_tokens_update"] / row["processed_tokens_update"], 4)
    seqs = row["batch_prompts"] * row["group_size"]
    prompts = row["real_tokens_update"] - row["gen_tokens_per_step"]
    assert 5 * seqs <= prompts <= 7 * seqs
    assert abs(row["loss_tokens_per_s"] - row["gen_tokens_per_s"]) <= 0.1
    assert row["flops_score"] == pytest.approx(row["flops_update"] / 3, rel=1e-12)
    assert 1 <= row["completion_len_p50"] <= row["completion_len_max"] <= row["max_tokens"]
    # the floors: each phase's useful FLOPs at the measured GEMM rate, the step's their sum;
    # sampling does less than one forward over the trained tokens (shared prefill, no last)
    rate = row["gemm_gflops"] * 1e9
    for phase in ("rollout", "score", "update"):
        assert row[f"floor_{phase}_s"] == pytest.approx(row[f"flops_{phase}"] / rate, rel=1e-3)
        assert row[f"floor_frac_{phase}"] == pytest.approx(
            row[f"floor_{phase}_s"] / row[f"time_{phase}_s"], rel=1e-2, abs=1e-4)
    assert row["floor_step_s"] == pytest.approx(sum(row[f"floor_{p}_s"] for p in (
        "rollout", "score", "update")), abs=2e-4)
    # the step's time holds the phases' and more: its fraction is below the best phase's
    assert 0 < row["floor_frac_step"] < max(row[f"floor_frac_{p}"] for p in (
        "rollout", "score", "update"))
    assert 0.3 * row["flops_update"] / 3 < row["flops_rollout"] < row["flops_update"] / 3


def test_grpo_step_benchmark_varlen_smallest(tmp_path):
    """varlen at 2 prompts x G=8: lengths vary and stay within max_tokens; padding is counted
    from the micro-batches as the update processed them."""
    (row,) = _run("grpo_step.py", "--workload", "varlen", "--nprocs", "1", "--warmup", "0",
                  "--steps", "1", "--set", "data.batch_size=2", "--out", "", timeout=900)
    assert row["workload"] == "varlen" and row["max_tokens"] == 96
    assert 1 <= row["completion_len_mean"] <= row["completion_len_max"] <= 96
    assert 0 <= row["padded_token_share"] < 1 and 0 < row["mfu_update"] < 1.5
    assert row["gen_tokens_per_step"] == pytest.approx(16 * row["completion_len_mean"], abs=0.1)


def test_profile_step_smallest(tmp_path):
    """One profiled demo step: every row of both phases is a share of the phase (they sum to
    1, none below zero beyond rounding), the update has a backward and an optimizer step,
    scoring has neither."""
    out = tmp_path / "p.json"
    (row,) = _run("profile_step.py", "--workload", "demo", "--warmup", "0", "--steps", "1",
                  "--set", "data.batch_size=8", "--out", str(out), timeout=900)
    assert json.loads(out.read_text()) == row
    for phase in ("update", "score"):
        share = row[phase]["share"]
        assert sum(share.values()) == pytest.approx(1.0, abs=1e-3)
        assert all(v >= -1e-3 for v in share.values()), share
        assert share["forward"] > 0 and share["output_loss"] > 0 and share["attention"] > 0
        assert 0 <= row[phase]["padded_token_share"] < 1 and 0 < row[phase]["mfu"] < 1.5
    assert row["update"]["share"]["backward"] > 0 and row["update"]["share"]["optimizer"] > 0
    assert row["score"]["seconds"]["backward"] == 0 and row["score"]["seconds"]["optimizer"] == 0


def _rec(system: str, workload: str, tok_s: float, cpu_tok_s: float, **kw) -> dict:
    return dict(system=system, workload=workload, dtype=kw.pop("dtype", "float32"),
                gen_tokens_per_s=tok_s, gen_tokens_per_cpu_s=cpu_tok_s, loadavg_1m=1.0, **kw)


def test_report_tables_from_synthetic_jsonl(tmp_path):
    """report.py picks each system's best setting and computes the ratios and verdicts."""
    recs = [_rec("megagrpo", "demo", 1000.0, 400.0, nproc=1, padded_token_share=0.3,
                 mfu_update=0.2, mfu_score=0.1),
            _rec("megagrpo", "demo", 1500.0, 500.0, nproc=2, padded_token_share=0.25,
                 floor_frac_rollout=0.95, floor_frac_score=0.3, floor_frac_update=0.91,
                 floor_frac_step=0.6, mfu_update=0.91, mfu_score=0.3),
            _rec("trl", "demo", 700.0, 600.0, threads=1),
            _rec("trl", "demo", 600.0, 350.0, threads=2),
            _rec("megagrpo", "varlen", 300.0, 200.0, nproc=1, padded_token_share=0.05,
                 mfu_update=0.4, mfu_score=0.2),
            _rec("trl", "varlen", 100.0, 120.0, threads=2),
            dict(system="megagrpo", workload="smollm2", dtype="float32", skipped="absent")]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    p = subprocess.run([sys.executable, str(BENCH / "report.py"), str(path), "--json"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    demo, varlen, smol = [json.loads(ln) for ln in p.stdout.splitlines()]
    assert (demo["megagrpo_nproc"], demo["trl_threads"]) == (2, 1)
    assert demo["ratio"] == pytest.approx(1500 / 700)
    assert demo["ratio_cpu"] == pytest.approx(500 / 600)
    assert demo["met"] == dict(ratio=True, ratio_cpu=False, floor_rollout=True,
                               floor_score=False, floor_update=True, padded_share=None)
    assert demo["floor_step"] == 0.6
    assert varlen["ratio"] == pytest.approx(3.0) and varlen["ratio_cpu"] == pytest.approx(200 / 120)
    # a record from before the rollout floor: score and update from its MFU fields
    assert varlen["met"] == dict(ratio=True, ratio_cpu=True, floor_rollout=None,
                                 floor_score=False, floor_update=False, padded_share=True)
    assert smol["skipped"] == "absent"
    md = subprocess.run([sys.executable, str(BENCH / "report.py"), str(path)],
                        capture_output=True, text=True, timeout=60).stdout
    assert "| demo | float32 | 1500 tok/s (2 ranks) | 700 tok/s (1 thread) | 2.14x | 0.83x |" in md
    assert f"not met (0.83x; {(1.0 - 500 / 600) / 1.0:.0%} short)" in md
    assert "| 95.0% | 30.0% | 91.0% | 60.0% |" in md
    assert "skipped: absent" in md


TRL_PY = ROOT / ".venv-trl" / "bin" / "python"


@pytest.fixture(scope="module")
def trl_python() -> str:
    """.venv-trl's python, built on demand by scripts/setup_trl_venv.sh (idempotent: a no-op
    once built); a failed build fails the test with the script's output, never skips it."""
    setup = ROOT / "scripts" / "setup_trl_venv.sh"
    try:
        p = subprocess.run(["bash", str(setup)], cwd=ROOT, capture_output=True, text=True,
                           timeout=3600)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{setup} did not build .venv-trl within {e.timeout}s", pytrace=False)
    if p.returncode != 0 or not TRL_PY.exists():
        pytest.fail(f"the TRL baseline needs .venv-trl: {setup} failed (rc={p.returncode}):\n"
                    f"{(p.stdout + p.stderr)[-3000:]}", pytrace=False)
    return str(TRL_PY)


# heavy: TRL lives in its own venv (TRL, datasets, accelerate: minutes of installs) that the
# default run and CI never build; `pytest -m heavy` builds it or fails saying why
@pytest.mark.heavy
def test_trl_baseline_one_step(tmp_path, trl_python):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    (row,) = _run("trl_grpo_baseline.py", "--workload", "demo", "--warmup", "0", "--steps", "1",
                  "--threads", "1", "--set", "data.batch_size=8",
                  "--out", str(tmp_path / "t.jsonl"), python=trl_python, timeout=900, env=env)
    assert row["gen_tokens_per_s"] > 0 and row["workload"] == "demo" and row["threads"] == 1
    assert row["optimizer_steps_per_step"] == 4  # demo's 4 minibatches, as megagrpo
    assert 1 <= row["completion_len_max"] <= row["max_tokens"]
