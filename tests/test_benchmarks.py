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

from tests.support.bench import bench_module as _bench_module
from tests.support.docs import assert_generated_table, between

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
PERF_DOC = ROOT / "docs" / "performance.md"


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
    """Every path at a toy size and the float64 check (Triton under the interpreter) at vocab
    sizes that are no block multiple, small enough for the interpreter."""
    out = tmp_path / "k.jsonl"
    rows = _run("kernels.py", "--device", "cpu", "--check", "--check-V", "4099,1031",
                "--T", "64", "--V", "512",
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


def test_fused_output_sweep_smallest(capsys):
    """--sweep at a toy size (in-process, fp32, one call per row): every chunk shape of the grid
    runs, on the path and chunk it says, and gives the logits path's gradients."""
    capsys.readouterr()
    _bench_module("fused_output").main(["--sweep", "--device", "cpu", "--H", "16", "--V", "512",
                                         "--T", "16", "--dtypes", "fp32", "--iters", "1"])
    rows = [json.loads(ln) for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
    assert rows[0]["sweep"] == "plan" and rows[0]["rows"] == len(rows) - 1
    done = [r for r in rows[1:] if "fwd_bwd_s" in r]
    assert len(done) == len(rows) - 1 and done[0]["path"] == "logits"
    assert {r["grad"] for r in done[1:]} == {"forward", "recompute"}
    assert all(r["chunk_tokens"] <= 16 and r["chunk_vocab"] <= 512 for r in done[1:])
    assert all(r["grad_max_rel_diff"] < 1e-5 and r["model_s"] > 0 for r in done), done


def test_performance_doc_h200_table_is_the_results():
    """docs/performance.md's H200 table (measured vs the model) is the one --gpu-table makes."""
    mod = _bench_module("fused_output")
    marker = "<!-- fused_output h200 table: generated by benchmarks/fused_output.py --gpu-table"
    assert_generated_table(PERF_DOC, marker, "<!-- end of h200 table -->",
                           mod.h200_table(str(BENCH / "results" / "fused_output_h200.jsonl")))


def test_performance_doc_fused_output_table_is_the_results_table():
    """docs/performance.md's fused output table is the one fused_output.py --table makes from
    benchmarks/results/fused_output_cpu.jsonl (figures are generated, never typed in)."""
    mod, results = _bench_module("fused_output"), BENCH / "results"
    assert_generated_table(PERF_DOC, "<!-- fused_output table: generated by",
                           "<!-- end of generated table -->",
                           mod.table(str(results / "fused_output_cpu.jsonl")))
    assert_generated_table(PERF_DOC, "<!-- fused_output fit:", "<!-- end of fit rows -->",
                           mod.fit_table(str(results / "fused_output_fit_cpu.jsonl")))


@pytest.mark.parametrize("results, marker", [
    ("throughput_cpu.jsonl", "throughput tables"),
    ("throughput_epyc_cpu.jsonl", "throughput tables (AMD EPYC)"),
    ("throughput_epyc_f25_cpu.jsonl", "throughput tables (AMD EPYC family 25)")])
def test_performance_doc_throughput_tables_are_the_report(results, marker):
    """docs/performance.md's megagrpo-vs-TRL tables are benchmarks/report.py's output on
    each results file (one per CPU they were measured on)."""
    report = _bench_module("report")
    got = report.markdown(report.summarize(report.read_records(BENCH / "results" / results)))
    assert_generated_table(PERF_DOC, f"<!-- {marker}: generated by benchmarks/report.py -->\n",
                           f"\n<!-- end of {marker} -->", got)


def test_performance_doc_targets_table_is_generated():
    """docs/performance.md's table of issue 33's targets is benchmarks/targets.py's output on
    benchmarks/results/."""
    mod = _bench_module("targets")
    assert_generated_table(PERF_DOC, "<!-- issue 33 targets: generated by benchmarks/targets.py",
                           "<!-- end of issue 33 targets -->",
                           mod.markdown(mod.rows(BENCH / "results")))


def test_performance_doc_kernel_table_is_the_profiles():
    """docs/performance.md's where-the-time-goes table is profile_step.py --table on the saved
    profiles it names."""
    mod = _bench_module("profile_step")
    marker = "<!-- kernel table: generated by benchmarks/profile_step.py --table"
    header = between(PERF_DOC, marker, "-->")
    files = header.split("--table", 1)[1].split()
    assert files, "the marker names the profile files"
    want = mod.markdown([json.loads((ROOT / f).read_text()) for f in files])
    assert_generated_table(PERF_DOC, marker, "<!-- end of kernel table -->", want)


def test_performance_doc_layer_split_table_is_the_results():
    """docs/performance.md's unprofiled split is layer_split.py --table on the file it names."""
    marker = "<!-- layer split table: generated by benchmarks/layer_split.py --table"
    (path,) = between(PERF_DOC, marker, "-->").split("--table", 1)[1].split()
    assert_generated_table(PERF_DOC, marker, "<!-- end of layer split table -->",
                           _bench_module("layer_split").table(str(ROOT / path)))


def _layer_split_rows(tmp_path, *compile_flag: str) -> list[dict]:
    """One toy decoder pass, quiet and beside a busy process (and compiled with --compile): the
    script's own check that the products it times alone are the model's weights passed (it
    exits otherwise), every part took time, the parts and the rest add up to the pass, the floor
    fraction is sane."""
    out = tmp_path / "s.jsonl"
    rows = _run("layer_split.py", "--preset", "tiny", "--threads", "1", "--neighbour",
                *compile_flag, "--iters", "1", "--out", str(out))
    n = 2 if compile_flag else 1
    assert [r["neighbour_threads"] for r in rows] == [0, os.cpu_count()] * n
    assert [bool(r["compiled"]) for r in rows] == [False, False] + [True, True] * (n - 1)
    for r in rows:
        assert r["step_s"] > 0 and r["gemm_s"] > 0 and r["attention_s"] > 0
        parts = r["gemm_s"] + r["attention_s"] + r["rest_s"]
        assert parts == pytest.approx(r["step_s"], abs=2e-4)  # three values rounded to 1e-4
        # the products timed alone are part of the pass: not (much) longer than all of it
        assert r["gemm_s"] + r["attention_s"] <= 1.1 * r["step_s"], r
        assert 0 < r["floor_frac"] < 1.5 and r["threads"] == 1
    assert _bench_module("layer_split").table(str(out)).count("| tiny (32 tokens") == len(rows)
    return rows


def test_layer_split_smallest(tmp_path):
    """The eager pass, quiet and beside a busy process (the compiled layers' correctness is
    tests/test_compile.py's; the script's --compile half is the heavy test below)."""
    _layer_split_rows(tmp_path)


@pytest.mark.heavy  # ~45 s of inductor compile (2-core Xeon); the eager half runs by default
def test_layer_split_compiled_smallest(tmp_path):
    """--compile: the compiled layers' pass beside the eager one, their gradients the eager
    ones'. Inductor compiles C++: CI must have a compiler (scripts/setup_venv.sh refuses to set
    up without one when CI is set)."""
    import shutil

    assert shutil.which("g++") or shutil.which("c++"), "inductor needs a C++ compiler: install g++"
    c = _layer_split_rows(tmp_path, "--compile")[-1]["compiled"]
    assert c["grad_max_rel_diff"] < 1e-4 and c["graphs"] >= 1 and c["compile_s"] > 0


@pytest.mark.heavy  # 150 s (2-core EPYC); fused_output.py keeps two smoke tests by default
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
    assert min(row[k] for k in ("repack_s", "plain_copy_s", "decode_packed_s",
                                "decode_plain_s", "memcpy_s")) > 0  # the repack split ran
    assert out.read_text().strip() == json.dumps(row)
    assert _bench_module("weight_sync").table(str(out)).count("\n") == 2  # header + one row


def test_weight_sync_separate_benchmark_tiny(tmp_path):
    """The separate placement rows (2 training ranks TP=2 + a rollout rank over gloo): what
    each sync moved against counts by hand for the tiny model (H 128, 2 layers, 4 heads of 32,
    2 KV heads, FFN 256, vocab 256, untied, fp32), and the table it renders. Full: the model
    plus the norms every TP rank sends (5 x 128 floats, once more); a delta after only the
    linears changed: the linears alone; the adapter: rank 16 on q/k/v/o and gate/up/down."""
    out = tmp_path / "ws.jsonl"
    (row,) = _run("weight_sync.py", "--separate", "--sizes", "tiny", "--repeats", "1",
                  "--out", str(out))
    H, F, V, L, q, kv, r = 128, 256, 256, 2, 128, 64, 16
    linears = L * (H * (q + 2 * kv) + q * H + 3 * F * H) * 4
    model = linears + (2 * V * H + L * 2 * H + H) * 4
    assert row["model_bytes"] == model and row["params"] * 4 == model
    assert row["full_bytes"] == row["delta, all changed_bytes"] == model + 5 * H * 4
    assert row["delta, linears changed_bytes"] == linears
    adapter = L * r * ((3 * H + q + 2 * kv) + (q + H) + (2 * H + 2 * F) + (F + H)) * 4
    assert row["adapter_bytes"] == adapter
    assert min(row[k] for k in row if k.endswith("_s")) > 0
    assert 0 < row["peak_train_mib"] and 0 < row["peak_rollout_mib"]
    lines = _bench_module("weight_sync").separate_table(str(out)).splitlines()
    assert len(lines) == 2 + 6 and "| separate, adapter | 0.262 MB |" in lines[-1]


def test_performance_doc_separate_weight_sync_table_is_the_results():
    """docs/performance.md's table of weight syncs to rollout ranks is the one
    --separate-table makes from the committed results."""
    assert_generated_table(
        PERF_DOC, "<!-- separate weight sync table: generated by benchmarks/weight_sync.py "
        "--separate-table", "<!-- end of separate weight sync table -->",
        _bench_module("weight_sync").separate_table(
            str(BENCH / "results" / "weight_sync_separate_cpu.jsonl")))


@pytest.mark.heavy  # 43 s; weight_sync.py keeps its tiny smoke test in the default suite
def test_weight_sync_benchmark_vllm_tp2_tiny(tmp_path):
    """The vLLM TP=2 rows (2 ranks under torchrun): the shard-to-shard feed receives less than
    the full-tensor one, and the engine it fed decodes like HF."""
    (row,) = _run("weight_sync.py", "--vllm-tp", "2", "--sizes", "tiny", "--repeats", "1",
                  "--out", str(tmp_path / "w2.jsonl"))
    assert row["greedy_agrees_with_hf"] and row["max_logprob_gap"] < 1e-4
    assert 0 < row["slices_received_bytes"] < row["full_received_bytes"]
    assert row["slices_s"] > 0 and row["disk_total_s"] > 0


# heavy (~16 s, a vLLM engine of its own): its table is checked on the committed results
# (tests/test_rollout_floor.py), its floor is rollout_floor.py's (hand-computed there, and the
# grpo_step.py smoke prices its rollout with it), vLLM samples the demo workload in many
# default tests; what is left is that the script runs
@pytest.mark.heavy
def test_rollout_settings_benchmark_demo(tmp_path):
    """One variant of the vLLM settings benchmark on the demo workload, one rollout: it
    samples, prices its floor and tabulates the row."""
    out = tmp_path / "rs.jsonl"
    (row,) = _run("rollout_settings.py", "--workload", "demo", "--variants", "seqs32",
                  "--rollouts", "1", "--out", str(out))
    assert row["overrides"] == ["rollout.max_num_seqs=32"] and row["gen_tokens"] > 0
    assert row["best_s"] > 0 and 0 < row["floor_s"] and row["decode_steps"] > 0
    assert "max_num_seqs=32" in _bench_module("rollout_settings").table(str(out))


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


def _demo_step(out: Path, *mode: str) -> dict:
    """grpo_step.py's demo at 1 rank, 8 prompts, one warm-up step then one measured step, in
    `mode` (eager layers, or --compile-ab: a compiled and an eager warm-up step, then one
    measured compiled step and one eager, the eager means under `eager`)."""
    (row,) = _run("grpo_step.py", "--workload", "demo", "--nprocs", "1", "--warmup", "1",
                  "--steps", "1", "--set", "data.batch_size=8", *mode, "--out", str(out),
                  timeout=900)
    return row


@pytest.fixture(scope="module")
def demo_eager(tmp_path_factory) -> tuple[dict, Path]:
    """One eager grpo_step.py demo launch (inductor's compile is test_compile.py's and the heavy
    --compile-ab test's). Returns (the record, the --out file)."""
    out = tmp_path_factory.mktemp("grpo_step") / "g.jsonl"
    return _demo_step(out, "--set", "compute.compile_layers=false"), out


def test_grpo_step_benchmark_one_rank_one_step(demo_eager):
    """demo at 1 rank: the new fields are present and sane, and they agree with each other:
    every completion token carries the loss; the update's real tokens are the completions plus
    prompts of 2-digit additions (BOS + 4..6 characters); scoring ran the old log-probs' pass
    only (the workload resets the reference every step, so it equals the policy and its pass is
    reused: compute.reuse_equal_reference), so its FLOPs are 1/3 of the update's (3 x one
    forward)."""
    row, out = demo_eager
    assert [json.loads(ln) for ln in out.read_text().splitlines()] == [row]
    assert row["gen_tokens_per_s"] > 0 and row["nproc"] == 1 and row["workload"] == "demo"
    assert 0 <= row["padded_token_share"] < 1 and row["gemm_gflops"] > 0
    from megagrpo.runtime.machine import cpu_name

    assert row["cpu"] == cpu_name()
    # the warm-up step, not in the means
    assert len(row["warmup_step_s"]) == 1 and min(row["warmup_step_s"]) > 0
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
    # (the rollout's: the larger of FLOPs and bytes per decode step, rollout_floor.py; never
    # below its FLOPs at the GEMM rate)
    rate = row["gemm_gflops"] * 1e9
    rel = max(1e-3, 0.051 / row["gemm_gflops"])  # the row keeps the rate to 0.1 GFLOP/s
    for phase in ("score", "update"):
        assert row[f"floor_{phase}_s"] == pytest.approx(row[f"flops_{phase}"] / rate, rel=rel)
    assert row["floor_rollout_flops_only_s"] == pytest.approx(row["flops_rollout"] / rate,
                                                              rel=rel)
    bw = _bench_module("rollout_floor").rollout_floor(
        row["rollout_profiles"], row["gemm_gflops"], row["mem_read_gbs"])
    assert row["floor_rollout_s"] == pytest.approx(bw["floor_s"] / row["steps"], rel=1e-3)
    assert row["floor_rollout_s"] >= row["floor_rollout_flops_only_s"] * (1 - 1e-3)
    for phase in ("rollout", "score", "update"):
        assert row[f"floor_frac_{phase}"] == pytest.approx(
            row[f"floor_{phase}_s"] / row[f"time_{phase}_s"], rel=1e-2, abs=1e-4)
    assert row["floor_step_s"] == pytest.approx(sum(row[f"floor_{p}_s"] for p in (
        "rollout", "score", "update")), abs=2e-4)
    # the step's time holds the phases' and more: its fraction is below the best phase's
    assert 0 < row["floor_frac_step"] < max(row[f"floor_frac_{p}"] for p in (
        "rollout", "score", "update"))
    assert 0.3 * row["flops_update"] / 3 < row["flops_rollout"] < row["flops_update"] / 3


@pytest.mark.heavy  # ~50 s of inductor compile (2-core Xeon); the eager demo step runs by default
def test_grpo_step_compile_ab_smallest(tmp_path):
    """--compile-ab at 8 prompts: the compiled steps' record with the alternated eager steps'
    means beside it, the compile seconds the first step paid, and the work per step that
    compile_layers=auto prices (8 x G=8 sequences of a prompt (BOS + 4-6 characters) and 6
    tokens, 5 forward equivalents: old log-probs and reference forwards + forward/backward,
    `report.auto_work_step` from the line)."""
    row = _demo_step(tmp_path / "g.jsonl", "--compile-ab")
    assert len(row["warmup_step_s"]) == 2  # the compiled warm-up step and the eager one
    assert row["compile_ab"] and "compute.compile_layers=true" in row["overrides"]
    assert row["compile_s"] > 0 and row["time_update_s"] > 0
    assert all(row["eager"][f"time_{p}_s"] > 0 for p in ("rollout", "score", "update"))
    assert 64 * (5 + 6) * 5 <= _bench_module("report").auto_work_step(row) <= 64 * (7 + 6) * 5


def test_grpo_step_compile_seconds_none_where_layers_are_eager():
    """A run whose layers were not compiled (compute.compile_layers=false) records no compile
    seconds."""
    from types import SimpleNamespace

    tr = SimpleNamespace(policy=torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert _bench_module("grpo_step").compile_seconds(tr) is None


@pytest.mark.heavy  # 58 s; grpo_step.py keeps its demo smoke test in the default suite
def test_grpo_step_benchmark_varlen_smallest(tmp_path):
    """varlen at 2 prompts x G=8: lengths vary and stay within max_tokens; padding is counted
    from the micro-batches as the update processed them."""
    (row,) = _run("grpo_step.py", "--workload", "varlen", "--nprocs", "1", "--warmup", "0",
                  "--steps", "1", "--set", "data.batch_size=2", "--set",
                  "compute.compile_layers=false", "--out", "", timeout=900)
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
                  "--set", "data.batch_size=8", "--set", "compute.compile_layers=false",
                  "--out", str(out), timeout=900)
    assert json.loads(out.read_text()) == row
    for phase in ("update", "score"):
        share = row[phase]["share"]
        assert sum(share.values()) == pytest.approx(1.0, abs=1e-3)
        assert all(v >= -1e-3 for v in share.values()), share
        assert share["forward"] > 0 and share["output_loss"] > 0 and share["attention"] > 0
        assert 0 <= row[phase]["padded_token_share"] < 1 and 0 < row[phase]["mfu"] < 1.5
    assert row["update"]["share"]["backward"] > 0 and row["update"]["share"]["optimizer"] > 0
    assert row["score"]["seconds"]["backward"] == 0 and row["score"]["seconds"]["optimizer"] == 0
    # the same phases by kernel: the rows sum to the phase, the GEMMs ran at a rate torch.mm's
    # can bound (the profiler's FLOPs are the GEMMs' own), and the table renders
    for phase in ("update", "score"):
        k = row[phase]["kernels"]
        assert sum(k["seconds"].values()) == pytest.approx(row[phase]["seconds"]["total"],
                                                           abs=2e-3)
        assert k["seconds"]["gemm"] > 0 and k["seconds"]["elementwise"] > 0
        assert 0 < k["gemm_rate_frac"] < 1.5 and k["top_gemms"] and k["top_other"]
        assert all(g["op"].startswith("aten::") for g in k["top_gemms"])
    # the CPU shim's calls were counted over a step (every forward op passes through it)
    assert row["shim"]["calls_per_step"] > 100 and row["shim"]["us_per_call"] >= 0
    table = _bench_module("profile_step").markdown([row])
    assert table.count("\n| demo float32, eager |") == 2  # the test sets compile_layers=false


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


def test_report_sp_table_from_synthetic_records():
    """report.py --sp: one row per sequence-parallel setting, read from each line's --set
    overrides, with the mean and range of every phase and the on / off ratio of the mean step."""
    report = _bench_module("report")

    def rec(sp, step, **kw):
        return dict(system="megagrpo", workload="moe", dtype="float32", tp=2, dp=1,
                    overrides=["parallel.tp=2", f"parallel.sequence_parallel={sp}"], step_s=step,
                    time_rollout_s=1.0, time_score_s=1.0, time_update_s=step - 2.0,
                    gen_tokens_per_s=1000.0 / step, floor_frac_update=0.2, loadavg_1m=1.5, **kw)

    md = report.sp_table([rec("true", 4.0), rec("false", 5.0), rec("true", 6.0),
                          rec("false", 5.0, ), dict(system="trl", step_s=1.0)])
    on, off = (ln for ln in md.splitlines() if ln.startswith(("| on", "| off")))
    assert on.startswith("| on | moe float32, TP=2 x DP=1 | 2 | 5.00 (4.00-6.00) |"), on
    assert off.startswith("| off | moe float32, TP=2 x DP=1 | 2 | 5.00 (5.00-5.00) |"), off
    assert "| 208 (167-250) |" in on  # tokens/s averaged over the runs, not recomputed
    assert md.endswith("without: 1.000.")


def test_performance_doc_sp_table_is_the_report():
    """docs/performance.md's sequence-parallel A/B table is `report.py --sp`'s output."""
    report = _bench_module("report")
    got = report.sp_table(report.read_records(BENCH / "results" / "moe_sp_epyc_cpu.jsonl"))
    assert_generated_table(PERF_DOC, "<!-- moe sp table: generated by benchmarks/report.py "
                           "--sp -->\n", "\n<!-- end of moe sp table -->", got)


def _step(system: str, workload: str, tok_s: float, dtype: str = "float32", **kw) -> dict:
    """A throughput line with the phase times and lengths targets.py quotes."""
    times = dict(time_rollout_s=0.1, time_score_s=0.2, time_update_s=0.3, completion_len_mean=5.0)
    if system == "megagrpo":
        times.update(nproc=1, time_weight_sync_s=0.01, flops_score=1.0)
    else:
        times.update(threads=2)
    return _rec(system, workload, tok_s, tok_s, dtype=dtype, **times, **kw)


def _jsonl(path: Path, recs: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_targets_verdicts_from_synthetic_results(tmp_path):
    """targets.py: a value at a target's bound meets it and one just past does not (>= and
    <= targets); the newest results file that measured a workload / dtype gives its row, the
    newest record in a file; a target no file measures is 'not measured' with the command to
    run, and a miss quotes its cause's figures."""
    mod = _bench_module("targets")
    at_least, at_most = mod.Target("x", 0.85), mod.Target("y", 2.0, at_most=True)
    assert [mod.verdict(v, at_least) for v in (0.85, 0.8499, None)] == [True, False, None]
    assert [mod.verdict(v, at_most) for v in (2.0, 2.0001)] == [True, False]
    _jsonl(tmp_path / "throughput_epyc_cpu.jsonl", [  # the newest CPU's run
        _step("megagrpo", "midsize", 500.0, floor_frac_score=0.85, floor_frac_update=0.8499,
              floor_frac_rollout=0.5),
        _step("trl", "midsize", 500.0),
        _step("megagrpo", "varlen", 300.0, floor_frac_score=0.70, floor_frac_update=0.6999),
        _step("trl", "varlen", 100.0),
        _step("megagrpo", "demo", 1499.0), _step("trl", "demo", 1000.0)])
    _jsonl(tmp_path / "throughput_cpu.jsonl", [  # an older CPU's: bf16, and a superseded midsize
        _step("megagrpo", "midsize", 900.0, floor_frac_score=0.99, floor_frac_update=0.99),
        _step("trl", "midsize", 100.0),
        _step("megagrpo", "demo", 1500.0, dtype="bfloat16"),
        _step("trl", "demo", 1000.0, dtype="bfloat16")])
    floor = dict(system="megagrpo", dtype="float32", workload="midsize", steps=2,
                 mem_read_gbs=40.0, time_rollout_s=1.0, rollout_decode_steps=20,
                 rollout_decode_flop_s=0.5, rollout_decode_byte_s=0.1,
                 rollout_bandwidth_bound_steps=0, loadavg_1m=2.0)
    _jsonl(tmp_path / "rollout_floor_epyc_cpu.jsonl", [
        dict(floor, floor_frac_rollout=0.2, floor_rollout_s=0.2),
        dict(floor, floor_frac_rollout=0.7, floor_rollout_s=0.7)])
    split = dict(preset="midsize", tokens=1024, threads=2, neighbour_threads=0, compiled=None,
                 gemm_share=0.66, gemm_rate_frac=0.99, attention_share=0.04,
                 attention_rate_frac=0.17, rest_share=0.30, floor_frac=0.65)
    _jsonl(tmp_path / "layer_split_cpu.jsonl", [
        split, dict(split, threads=1, gemm_share=0.1), dict(split, compiled={"graphs": 1},
                                                             gemm_share=0.2)])
    share = dict(gemm=0.57, attention=0.06, copy=0.12, elementwise=0.2, overhead=0.05)
    (tmp_path / "profile_midsize_epyc_cpu.json").write_text(json.dumps(dict(
        update=dict(kernels=dict(gemm_rate_frac=0.78, share=share)),
        score=dict(kernels=dict(gemm_rate_frac=0.63, share=share)), cpu="Some CPU (family 9)")))
    _jsonl(tmp_path / "weight_sync_repack_cpu.jsonl", [dict(
        size="100m", sync_s=0.5, disk_total_s=1.5, memcpy_s=0.25, engine_load_s=0.45,
        gather_convert_s=0.01, repack_s=0.4, plain_copy_s=0.25, decode_plain_s=2.0,
        decode_packed_s=1.0, disk_write_s=0.5, disk_read_load_s=1.0)])
    got = {(r["target"].split(" ")[0] + r["target"].split(" ")[1], r["workload"], r["dtype"]): r
           for r in mod.rows(tmp_path)}
    verdicts = {k: r["met"] for k, r in got.items()}
    assert verdicts[("score>=", "midsize", "float32")] is True
    assert verdicts[("update>=", "midsize", "float32")] is False  # not the older CPU's 0.99
    assert "GEMMs 66% at 99% of torch.mm" in got[("update>=", "midsize", "float32")]["cause"]
    assert ("GEMM 57% of the phase at 78% of torch.mm" in  # the profile names its own CPU
            got[("update>=", "midsize", "float32")]["cause"])
    assert "(profile_midsize_epyc_cpu.json, Some CPU (family 9))" in got[
        ("update>=", "midsize", "float32")]["cause"]
    assert got[("update>=", "midsize", "float32")]["source"] == (
        "throughput_epyc_cpu.jsonl, AMD EPYC")
    assert (verdicts[("score>=", "varlen", "float32")],
            verdicts[("update>=", "varlen", "float32")]) == (True, False)
    assert "profile_step.py --workload varlen" in got[("update>=", "varlen", "float32")]["cause"]
    for key in (("score>=", "moe", "float32"), ("update>=", "smollm2", "float32"),
                (">=1x", "moe", "bfloat16"), ("rollout>=", "smollm2", "float32")):
        assert got[key]["met"] is None and got[key]["value"] is None, key
        assert got[key]["cause"].startswith("not measured: `"), key
    assert ('RUNS="moe:bfloat16" bash benchmarks/throughput.sh'
            in got[(">=1x", "moe", "bfloat16")]["cause"])
    # the newest rollout floor record, exactly at 70%
    assert got[("rollout>=", "midsize", "float32")]["value"] == 0.7
    assert verdicts[("rollout>=", "midsize", "float32")] is True
    demo = [r for r in mod.rows(tmp_path) if r["workload"] == "demo"]
    assert [(r["dtype"], r["shown"], r["met"]) for r in demo] == [
        ("float32", "1.50x", True), ("float32", "1.49x", False),  # 1.499x: short of 1.5x
        ("bfloat16", "1.50x", True), ("bfloat16", "1.50x", True)]
    assert "update 0.300 vs 0.300" in demo[1]["cause"] and demo[0]["cause"] == ""
    refit = [r for r in mod.rows(tmp_path) if r["workload"] == "100m"]
    assert [(r["value"], r["met"]) for r in refit] == [(3.0, True), (2.0, True)]
    md = mod.markdown(mod.rows(tmp_path))
    assert ("| rollout >= 70% of its bandwidth-aware floor | smollm2 | float32 | - "
            "| not measured |") in md
    assert "| >= 1.5x TRL tokens/s | demo | float32 | 1.49x | not met |" in md
    assert "| update >= 85% of its FLOP floor | midsize | float32 | 84.9% | not met |" in md


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


def test_performance_doc_layer_split_figures_are_the_results():
    """docs/performance.md's why-not-90% sentence quotes the quiet 2-thread rows of the layer
    split, eager and compiled."""
    rows = [json.loads(ln) for ln in
            (BENCH / "results" / "layer_split_cpu.jsonl").read_text().splitlines()]
    quiet = [r for r in rows if r["threads"] == 2 and not r["neighbour_threads"]]
    eager = [r for r in quiet if not r["compiled"]]
    compiled = [r for r in quiet if r["compiled"]]
    assert len(eager) == len(compiled) == 2

    def span(rows: list[dict], key: str) -> str:
        lo, hi = (round(100 * f(r[key] for r in rows)) for f in (min, max))
        return f"{lo}%" if lo == hi else f"{lo}-{hi}%"

    graphs = sorted({r["compiled"]["graphs"] for r in compiled})
    doc = " ".join(PERF_DOC.read_text().split())
    for figure in (f"running at {span(eager, 'gemm_rate_frac')} of `torch.mm`'s rate",
                   f"{span(eager, 'attention_share')} in attention",
                   f"a layer reaches {span(eager, 'floor_frac')} of its floor",
                   f"({graphs[0]}-{graphs[-1]} graphs a layer) brought that to "
                   f"{span(compiled, 'floor_frac')}"):
        assert figure in doc, figure


BF16_ACCURACY_RUNS = {  # docs/performance.md "bf16 accuracy": row label -> results folder
    "fp32, 0 / 0": "smollm2_dtype_xeon_cpu/fp32_seed0",
    "bf16, 0 / 0": "smollm2_recipe_bf16_cpu",
    "fp32, 1 / 1": "smollm2_dtype_xeon_cpu/fp32_seed1",
    "bf16, 1 / 1": "smollm2_dtype_xeon_cpu/bf16_seed1",
}


def smollm2_run(folder: str):
    """A SmolLM2 run's held-out accuracy by step and `mean(key, a, b)`: a metric's mean over
    steps a..b (every one of them logged)."""
    rows = [json.loads(ln) for ln in
            (BENCH / "results" / folder / "metrics.jsonl").read_text().splitlines()]
    ev = {r["step"]: r["eval_accuracy"] for r in rows if "eval_accuracy" in r}
    steps = [r for r in rows if "reward_mean" in r]

    def mean(key: str, a: int, b: int) -> float:
        xs = [r[key] for r in steps if a <= r["step"] <= b]
        assert len(xs) == b - a + 1, (folder, key, a, b)
        return sum(xs) / len(xs)

    return ev, mean


def bf16_accuracy_row(label: str, folder: str) -> str:
    """One row of the bf16-accuracy table from a run's metrics.jsonl."""
    ev, mean = smollm2_run(folder)

    def early_late(key: str, fmt: str) -> str:
        return f"{mean(key, 1, 5):{fmt}} / {mean(key, 26, 30):{fmt}}"

    return (f"| {label} | {ev[0]:.3f} -> {ev[15]:.3f} -> {ev[30]:.3f} | "
            f"{early_late('reward_mean', '.3f')} | {early_late('completion_len', '.1f')} | "
            f"{early_late('entropy', '.3f')} | {mean('logp_gap_vllm_mean', 1, 30):.2g} |")


def test_performance_doc_bf16_accuracy_rows_are_the_runs():
    """docs/performance.md's bf16-vs-fp32 accuracy rows are the committed runs' metrics."""
    doc = (ROOT / "docs" / "performance.md").read_text()
    block = doc[doc.index("<!-- bf16 accuracy rows -->"):doc.index("<!-- end of bf16 accuracy")]
    for label, folder in BF16_ACCURACY_RUNS.items():
        assert bf16_accuracy_row(label, folder) in block, label


def test_performance_doc_bf16_accuracy_figures_are_the_runs():
    """docs/performance.md's bf16 sentence quotes the runs' held-out accuracy after 30 steps."""
    after = {}
    for label, folder in BF16_ACCURACY_RUNS.items():
        rows = (BENCH / "results" / folder / "metrics.jsonl").read_text().splitlines()
        acc = [json.loads(ln)["eval_accuracy"] for ln in rows if '"eval_accuracy"' in ln]
        after.setdefault(label.split(",")[0], []).append(acc[-1])
    doc = " ".join(PERF_DOC.read_text().split())
    bf16, fp32 = sorted(after["bf16"]), sorted(set(after["fp32"]))
    assert len(fp32) == 1, "one fp32 figure quoted: the seeds agreed"
    assert (f"held-out {bf16[0]:.3f}-{bf16[-1]:.3f} after 30 steps against {fp32[0]:.3f} in "
            "fp32") in doc


DTYPE_15_RUNS = {  # docs/performance.md "bf16 accuracy", the 15-step table: label -> folder
    **BF16_ACCURACY_RUNS,
    "fp16, 0 / 0": "smollm2_dtype_xeon_cpu/fp16_seed0",
    "bf16 at lr 5e-5, 0 / 0": "smollm2_dtype_xeon_cpu/bf16_lr5e-5_seed0",
}


def dtype_15_row(label: str, folder: str) -> dict:
    """Steps 1-15 of a SmolLM2 run: held-out accuracy at 0 and 15, the means over steps 11-15
    of the train reward, completion length and entropy, and the mean gap over steps 1-15."""
    ev, mean = smollm2_run(folder)
    return {"acc0": ev[0], "acc15": ev[15], "line":
            f"| {label} | {ev[0]:.3f} -> {ev[15]:.3f} | {mean('reward_mean', 11, 15):.3f} | "
            f"{mean('completion_len', 11, 15):.1f} | {mean('entropy', 11, 15):.3f} | "
            f"{mean('logp_gap_vllm_mean', 1, 15):.2g} |"}


def test_performance_doc_dtype_15_step_rows_are_the_runs():
    """docs/performance.md's 15-step dtype rows (fp16 and a 10x learning rate beside fp32 and
    bf16) and the sentence after them are the committed runs' metrics."""
    doc = PERF_DOC.read_text()
    block = doc[doc.index("<!-- dtype 15-step rows -->"):doc.index("<!-- end of dtype 15-step")]
    rows = {label: dtype_15_row(label, folder) for label, folder in DTYPE_15_RUNS.items()}
    for label, row in rows.items():
        assert row["line"] in block, label
    text = " ".join(doc.split())
    fp32 = sorted(r["acc15"] for k, r in rows.items() if k.startswith("fp32"))
    bf16 = sorted(r["acc15"] for k, r in rows.items() if k.startswith("bf16,"))
    lr10 = rows["bf16 at lr 5e-5, 0 / 0"]["acc15"]
    for figure in (f"fp16 reached {rows['fp16, 0 / 0']['acc15']:.3f}",
                   f"bf16 at ten times the learning rate {lr10:.3f}",
                   f"fp32's {fp32[0]:.3f}-{fp32[-1]:.3f}", f"bf16's {bf16[0]:.3f}-{bf16[-1]:.3f}"):
        assert figure in text, figure


def test_lora_memory_benchmark_demo():
    """LoRA vs full fine-tuning on the demo model: the adapters are all that trains, their Adam
    state is 2 fp32 moments each, the reference copy is gone, and a refit between merges is the
    adapters alone (the base with them after a merge)."""
    from megagrpo.runtime.procs import free_port

    env = dict(os.environ, PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               LOCAL_WORLD_SIZE="1")
    full, lora = _run("lora_memory.py", "--workload", "demo", "--rank", "4", "--repeats", "1",
                      "--seq", "16", env=env)
    assert (full["mode"], lora["mode"]) == ("full", "lora")
    assert 0 < lora["trainable"] < full["trainable"] / 5
    assert lora["opt_state_bytes"] == 8 * lora["trainable"]
    assert full["opt_state_bytes"] == 8 * full["trainable"]
    assert lora["reference_bytes"] == 0 < full["reference_bytes"]
    assert lora["refit_merged_bytes"] == full["refit_full_bytes"]
    assert lora["refit_after_merge_bytes"] == full["refit_full_bytes"] + lora["refit_adapter_bytes"]
    assert 0 < lora["refit_adapter_bytes"] < full["refit_full_bytes"] / 10


@pytest.mark.heavy
def test_lora_decode_benchmark_tiny(tmp_path):
    """The decode comparison behind lora.refit=auto on a tiny Llama: every mode decodes the
    same token count and the adapter row is scaled to the merged one. Heavy: three vLLM starts."""
    from tests.support.tiny import tiny_llama

    model = tmp_path / "m"
    tiny_llama(model)
    out = tmp_path / "rows.jsonl"
    rows = _run("lora_decode.py", "--model", str(model), "--rank", "8", "--prompts", "2",
                "--tokens", "3", "--repeats", "1", "--work", str(tmp_path), "--out", str(out))
    assert [r["mode"] for r in rows] == ["merged", "adapter", "base"]
    assert {r["new_tokens"] for r in rows} == {6}
    done = [json.loads(x) for x in out.read_text().splitlines()]
    adapter = next(r for r in done if r["mode"] == "adapter")
    assert adapter["vs_merged"] == round(adapter["tokens_per_s"] / done[0]["tokens_per_s"], 3)


def test_lora_doc_decode_table_is_the_results():
    """docs/lora.md's decode table is lora_decode.py --table on the results file it names."""
    doc = ROOT / "docs" / "lora.md"
    marker = "<!-- lora decode table: generated by benchmarks/lora_decode.py --table"
    (path,) = between(doc, marker, "-->").split("--table", 1)[1].split()
    block = between(doc, marker, "<!-- end of lora decode table -->").split("-->\n", 1)[1]
    assert block.strip() == _bench_module("lora_decode").table(str(ROOT / path))


def test_performance_doc_lora_tables_are_the_results():
    """docs/performance.md's LoRA-vs-full tables (and their target lines) are lora_memory.py
    --table on the results file the marker names; the file names the CPU and load average."""
    marker = "<!-- lora table: generated by benchmarks/lora_memory.py --table"
    (path,) = between(PERF_DOC, marker, "-->").split("--table", 1)[1].split()
    block = between(PERF_DOC, marker, "<!-- end of lora table -->").split("-->\n", 1)[1]
    assert block.strip() == _bench_module("lora_memory").table(str(ROOT / path))
    rows = [json.loads(ln) for ln in (ROOT / path).read_text().splitlines() if ln.strip()]
    assert {r["workload"] for r in rows} >= {"midsize", "smollm2"}
    assert all(r["cpu"] and r["loadavg_1m"] >= 0 and r["lora_rank"] == 16 for r in rows)


def test_recompute_memory_benchmark_smallest(tmp_path):
    """One setting in its own process (each costs a process start): full recomputation runs
    layer 0's forward twice in the step (tests/test_seqpar.py counts none and selective)."""
    (row,) = _run("recompute_memory.py", "--seq", "32", "--batch", "1", "--attention", "sdpa",
                  "--recompute", "full", "--threads", "1", "--out", str(tmp_path / "r.jsonl"))
    assert (row["recompute"], row["layer_forwards"]) == ("full", 2), row
    assert row["step_peak_mib"] >= 0 and row["step_s"] > 0
    # the planner's figure beside it (issue 32): its estimate, the error, the saved activations
    assert row["planner_mib"] > 0 and row["planner_act_mib"] > 0 and row["saved_mib"] > 0, row
    if row["step_peak_mib"] > 0:  # the error of the printed (rounded) figures
        err = (row["planner_mib"] - row["step_peak_mib"]) / row["step_peak_mib"]
        assert abs(row["planner_error"] - err) < 0.01, row


GPU_STEP_DOC_START = "<!-- gpu step table: generated by benchmarks/gpu_step.py --table"
GPU_STEP_DOC_END = "<!-- end of gpu step table -->"


def test_gpu_step_smallest_without_vllm(tmp_path):
    """gpu_step.py at its tiny CPU shape (fp32, eager) with `vllm` unimportable (the lent GPU
    machine has none): every layout x output path ran through megagrpo's passes, its figures
    are there and sane, its loss, whole gradient and scored log-probs equal the eager padded
    fused reference's to fp32 rounding (the script's own `ok`), packing processed only the
    real tokens, and the table and --write render the rows between the doc markers."""
    out = tmp_path / "g.jsonl"
    argv = ["gpu_step.py", "--device", "cpu", "--shape", "tiny", "--compile", "off",
            "--out", str(out)]
    code = ("import runpy, sys; sys.modules['vllm'] = None; "
            f"sys.argv = {argv!r}; runpy.run_path({str(BENCH / 'gpu_step.py')!r}, "
            "run_name='__main__'); "
            "assert not [m for m, v in sys.modules.items() if m.startswith('vllm') and v], "
            "'vllm imported'")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # CPU: torch path
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-4000:]
    rows = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert {(r["layout"], r["output"]) for r in rows} == {
        (a, b) for a in ("padded", "packed") for b in ("fused", "logits")}
    for r in rows:
        assert r["ok"] and r["compile_layers"] is False, r
        assert r["loss_rel_diff"] < 1e-5 and r["grad_rel_diff"] < 1e-5, r
        assert r["grad_norm_rel_diff"] < 1e-5 and r["logp_max_abs_diff"] < 1e-5, r
        assert r["grad_norm"] > 0 and r["loss"] != 0
        for kind in ("update", "score"):
            assert r[f"{kind}_s"] > 0 and r[f"tflops_{kind}"] >= 0 and r[f"mfu_{kind}"] > 0
            assert r[f"tokens_per_s_{kind}"] == pytest.approx(r["real_tokens"] / r[f"{kind}_s"],
                                                              rel=1e-3)
            assert r[f"peak_gib_{kind}"] > 0
        assert r["update_flops"] == pytest.approx(3 * r["score_flops"])
        assert r["mm_tflops"] > 0 and r["layer_spec"] == "local" and r["attention"] == "sdpa"
        # packed: the rows' real tokens only; padded: rows x the longest row
        want = r["real_tokens"] if r["layout"] == "packed" else r["rows"] * r["seq"]
        assert r["processed_tokens"] == want, r
    assert rows[0]["real_tokens"] < rows[0]["rows"] * rows[0]["seq"]  # lengths vary
    mod = _bench_module("gpu_step")
    generated = mod.table(str(out))
    assert sum(ln.startswith("| off | ") for ln in generated.splitlines()) == 4
    doc = tmp_path / "perf.md"
    doc.write_text(f"intro\n{GPU_STEP_DOC_START} {out} -->\nold\n{GPU_STEP_DOC_END}\ntail\n")
    mod.main(["--table", str(out), "--write", str(doc)])
    assert_generated_table(doc, GPU_STEP_DOC_START, GPU_STEP_DOC_END, generated)
    assert doc.read_text().endswith(f"{GPU_STEP_DOC_END}\ntail\n") and "old" not in \
        doc.read_text()


def test_performance_doc_gpu_step_table_is_the_results():
    """docs/performance.md's H200 step table is gpu_step.py --table of the file its marker
    names. Until the H200 run is recorded the file is absent: the doc then holds the
    generator's placeholder line, and the comparison of rows is skipped."""
    (path,) = between(PERF_DOC, GPU_STEP_DOC_START, "-->").split("--table", 1)[1].split()
    generated = _bench_module("gpu_step").table(str(ROOT / path))
    if not (ROOT / path).exists():
        assert generated.replace(str(ROOT / path), path) in between(
            PERF_DOC, GPU_STEP_DOC_START, GPU_STEP_DOC_END)
        pytest.skip(f"{path} not recorded yet (the H200 run writes it)")
    assert_generated_table(PERF_DOC, GPU_STEP_DOC_START, GPU_STEP_DOC_END, generated)


def test_gpu_step_table_keeps_failed_rows(tmp_path):
    """A row whose passes raised on the GPU (`error`) shows in the table as failed, beside the
    measured rows, instead of breaking the table (one GPU session brings back what it can)."""
    mod = _bench_module("gpu_step")
    base = dict(bench="gpu_step", compile_layers=False, layout="padded", processed_tokens=16,
                update_s=0.5, score_s=0.1, tflops_update=300.0, mfu_update=0.4,
                tflops_score=250.0, mfu_score=0.33, tokens_per_s_update=24576.0,
                tokens_per_s_score=122880.0, peak_gib_update=40.0, peak_gib_score=12.0,
                loss_rel_diff=0.0, grad_rel_diff=0.0, device="GPU", torch="2.11", dtype="bf16",
                params=1.4e9, rows=8, seq=2048, real_tokens=12288, loss_tokens=10240,
                mm_tflops=790.0, mm_n=8192, layer_spec="local", attention="sdpa")
    rows = [dict(base, output="fused"),
            dict(base, output="logits", compile_layers=True, error="RuntimeError: boom")]
    path = tmp_path / "g.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = mod.table(str(path)).splitlines()
    assert lines[2].startswith("| off | padded (16 tokens) | fused | 500 ms | 300 (40%) |")
    assert lines[3].startswith("| on | padded | logits | failed: RuntimeError: boom |")
    assert lines[3].count("|") == lines[2].count("|")


def test_performance_doc_kernels_h200_table_is_the_results():
    """docs/performance.md's H200 kernel table is `kernels.py --table` of the committed rows."""
    kb = _bench_module("kernels")  # not `import kernels`: that name is Hugging Face's package

    doc = (ROOT / "docs" / "performance.md").read_text()
    start = doc.index(kb.DOC_START)
    block = doc[doc.index("\n", start) + 1:doc.index(kb.DOC_END)].strip()
    assert block == kb.table(str(ROOT / "benchmarks" / "results" / "kernels_h200.jsonl"))
def test_recompute_memory_cp2_splits_the_row(tmp_path):
    """The --cp 2 path (two processes over gloo): each CP rank saves for backward about half of
    what the single process saves for the whole row at the same S, adjusted by what the
    planner says CP changes (the K and V all-gathered over the row in place of the rank's own K
    and fused QKV output): a CP path that ran the whole row on each rank, or no CP at all,
    saves ~2x that. midsize at S = 256."""
    rows = _run("recompute_memory.py", "--seq", "256", "--batch", "1", "--attention", "sdpa",
                "--recompute", "none", "--cp", "1,2", "--model", "midsize", "--threads", "2",
                "--out", str(tmp_path / "r.jsonl"))
    one, two = (next(r for r in rows if r["cp"] == cp) for cp in (1, 2))
    assert len(two["rank_step_peak_mib"]) == 2 and two["layer_forwards"] == 1, two
    assert two["cp_attn"] == "blocks"
    # per layer (4), fp32: + K and V of the row (2 x 256 tokens x 4 KV heads x 64), - the
    # rank's 128 tokens' own K (256) and fused QKV output (1024)
    delta = 4 * (2 * 256 * 256 - 128 * (256 + 1024)) * 4 / 2**20
    assert two["saved_mib"] == pytest.approx(one["saved_mib"] / 2 + delta, rel=0.1), (one, two)
    assert two["planner_act_mib"] == pytest.approx(one["planner_act_mib"] / 2 + delta,
                                                   abs=0.1)


def test_performance_doc_planner_memory_table_is_the_results():
    """docs/performance.md's activation-memory table (measured rows beside the planner's
    figures at the current megagrpo/plan/memory.py) is recompute_memory.py --plan-table on the
    results file its marker names, and the planner's activation term is within 2% of the saved
    activations of every SDPA row without full recomputation (the formula counts what the
    layers save; Korthikanti's was 29% under)."""
    marker = "<!-- planner memory table: generated by benchmarks/recompute_memory.py --plan-table"
    (path,) = between(PERF_DOC, marker, "-->").split("--plan-table", 1)[1].split()
    mod = _bench_module("recompute_memory")
    assert_generated_table(PERF_DOC, marker, "<!-- end of planner memory table -->",
                           mod.plan_table(str(ROOT / path)))
    rows = [json.loads(ln) for ln in (ROOT / path).read_text().splitlines() if ln.strip()]
    for r in rows:
        if r["attention"] == "sdpa" and r["recompute"] != "full":
            act = mod.planner_mib(r["recompute"], r["attention"], r["seq"], r["batch"])[1]
            assert act == pytest.approx(r["saved_mib"], rel=0.02), r


def test_context_parallel_doc_memory_table_is_the_results():
    """docs/context-parallel.md's long-context memory table (measured rows, the linear fits and
    the longest sequence fitting 20 GiB) is recompute_memory.py --table on the results file its
    marker names; every row names the CPU and the load average."""
    doc = ROOT / "docs" / "context-parallel.md"
    marker = "<!-- cp memory table: generated by benchmarks/recompute_memory.py --table"
    (path,) = between(doc, marker, "-->").split("--table", 1)[1].split()
    assert_generated_table(doc, marker, "<!-- end of cp memory table -->",
                           _bench_module("recompute_memory").table(str(ROOT / path)))
    rows = [json.loads(ln) for ln in (ROOT / path).read_text().splitlines() if ln.strip()]
    assert {r["cp"] for r in rows} == {1, 2} and all(r["model"] == "midsize" for r in rows)
    assert all(r["cpu"] and r["loadavg_1m"] >= 0 for r in rows)


def test_gpu_trainer_smoke_on_cpu_without_vllm(tmp_path):
    """benchmarks/gpu_trainer_smoke.py (the first CUDA run's check) on CPU with `vllm`
    unimportable, as on the lent GPU machine: its random engine stands in, 2 whole trainer
    steps run (rollout, scoring, update, weight sync), each prints a finite loss and gradient
    norm, the weights change and the engine receives the weight export (exit 0)."""
    code = ("import runpy, sys; sys.modules['vllm'] = None; "
            f"sys.argv = ['gpu_trainer_smoke.py', '--steps', '2', '--out-dir', "
            f"{str(tmp_path / 'run')!r}]; "
            f"runpy.run_path({str(BENCH / 'gpu_trainer_smoke.py')!r}, run_name='__main__')")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-4000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("[smoke]")]
    steps = [ln for ln in lines if ln.startswith("[smoke] step ")]
    assert len(steps) == 2 and not any("NOT FINITE" in ln for ln in steps), lines
    assert "engine random" in lines[0] and "policy on cpu" in lines[0], lines
    assert any(ln.startswith("[smoke] weight syncs: ") and " 0 tensors" not in ln
               for ln in lines), lines
    assert lines[-1].startswith("[smoke] ok: weights changed True"), lines


def test_workload_with_an_absent_data_file_is_skipped_naming_the_command():
    """A workload whose recipe reads a data file no install step makes (smollm2's word
    problems) is skipped with the command that makes it, instead of a traceback mid-launch."""
    import dataclasses

    W = _bench_module("_workloads")
    smol = W.get_workload("smollm2")
    assert smol.data_file == "data/word_problems/train.jsonl"
    absent = dataclasses.replace(smol, model_dir="", data_file="data/absent/train.jsonl")
    why = W.missing_model(absent)
    assert "data/absent/train.jsonl is absent" in why
    assert "python -m megagrpo.tasks.word_problems data/word_problems" in why
    assert W.missing_model(dataclasses.replace(smol, model_dir="", data_file="README.md")) == ""


def test_performance_doc_compile_ab_table_is_the_report():
    """docs/performance.md's compiled-vs-eager whole-step table is `report.py --compile`'s
    output on the results file its marker names."""
    report = _bench_module("report")
    got = report.compile_table(report.read_records(BENCH / "results" / "compile_ab_cpu.jsonl"))
    assert_generated_table(PERF_DOC, "<!-- compile ab table: generated by benchmarks/report.py "
                           "--compile benchmarks/results/compile_ab_cpu.jsonl -->\n",
                           "\n<!-- end of compile ab table -->", got)


def test_compile_table_rows():
    """report.compile_table: the eager -> compiled seconds of each --compile-ab line, the ratio
    of score + update, the seconds saved per token pass, layer and unit of hidden size (auto's
    AUTO_SAVED_S), and the steps that repay the compile (compile s / score + update seconds
    saved a step; 'never' where they are not faster, whatever the rollout did); other lines
    are not rows."""
    report = _bench_module("report")
    rec = dict(system="megagrpo", workload="demo", compile_ab=True, steps=4, compile_s=12.0,
               nproc=2, batch_prompts=32, group_size=8, overrides=[], dtype="float32", dp=2,
               processed_tokens_update=256 * 9.0, completion_len_mean=4.0,
               time_score_s=0.1, time_update_s=0.2, step_s=0.5, loadavg_1m=1.0, cpu="X",
               model=dict(hidden=128, layers=4, vocab=19),
               eager=dict(time_score_s=0.2, time_update_s=0.3, step_s=0.6))
    slower = dict(rec, step_s=0.4, time_update_s=0.45, overrides=["data.task=file"])
    rows = report.compile_table([rec, slower, dict(rec, compile_ab=False)]).splitlines()[2:]
    assert rows == [  # 0.2 s saved / (128 sequences x (5 + 6) tokens x 5 passes x 4 x 128)
        "| demo | 2 x 32 x 8 | 128 x 4, 19 | 4 | 0.200 -> 0.100 | 0.300 -> 0.200 "
        "| 0.600 -> 0.500 | 0.60 | 5.5e-08 | 12.0 | 60 | 1.00 | X |",
        "| demo, prompts from a file | 2 x 32 x 8 | 128 x 4, 19 | 4 | 0.200 -> 0.100 "
        "| 0.300 -> 0.450 | 0.600 -> 0.400 | 1.10 | -1.4e-08 | 12.0 | never | 1.00 | X |"]


def test_auto_work_step_is_the_rule_on_the_workload():
    """A --compile-ab line is priced by compile_layers=auto's own rule on the workload's
    config: the demo (1 rank, 32 prompts x G=8, max_tokens 6, beta > 0
    with 4 minibatches: a reference and an old-log-prob forward + one update, 5 passes), its
    prompts' mean length from the update's tokens less the completions' mean."""
    report = _bench_module("report")
    rec = dict(workload="demo", dtype="float32", overrides=[], batch_prompts=32, group_size=8,
               dp=1, processed_tokens_update=256 * 12.0, completion_len_mean=5.0)
    assert report.auto_work_step(rec) == pytest.approx(256 * (7.0 + 6) * 5)


def test_compile_auto_constants_stand_on_the_compile_ab_rows():
    """compute.compile_layers=auto's prices are the measurements': AUTO_SAVED_S no more than
    any committed --compile-ab row at hidden <= AUTO_MAX_HIDDEN saved per token pass, layer and
    unit of hidden, AUTO_COMPILE_S no less than any compile those rows paid."""
    from megagrpo.config.compile import AUTO_COMPILE_S, AUTO_MAX_HIDDEN, AUTO_SAVED_S

    report = _bench_module("report")
    rows = [r for r in report.read_records(BENCH / "results" / "compile_ab_cpu.jsonl")
            if r.get("compile_ab") and "skipped" not in r
            and r["model"]["hidden"] <= AUTO_MAX_HIDDEN]
    assert len(rows) >= 5
    assert AUTO_SAVED_S <= min(report.saved_per_unit(r) for r in rows)
    assert AUTO_COMPILE_S >= max(r["compile_s"] for r in rows)


def test_performance_doc_demo_profile_table_is_the_profiles():
    """docs/performance.md's demo before/after table (eager vs compiled layers) is
    profile_step.py --table on the two saved profiles its marker names, labelled by their
    compute.compile_layers setting."""
    mod = _bench_module("profile_step")
    marker = "<!-- demo profile table: generated by benchmarks/profile_step.py --table"
    files = between(PERF_DOC, marker, "-->").split("--table", 1)[1].split()
    recs = [json.loads((ROOT / f).read_text()) for f in files]
    want = mod.markdown(recs)
    assert "demo float32, eager | update" in want and "demo float32, layers compiled" in want
    assert_generated_table(PERF_DOC, marker, "<!-- end of demo profile table -->", want)


def test_sandbox_benchmark_smallest():
    """benchmarks/sandbox.py times each isolation's call (2 calls each): every row ran, the
    kernel rows where bubblewrap runs here."""
    from megagrpo.agent.isolation import kernel_isolation

    rows = {r["row"]: r for r in _run("sandbox.py", "--calls", "2")}
    assert {"bare interpreter", "weak"} <= set(rows), rows
    assert any(name.startswith("kernel") for name in rows) == (kernel_isolation() == "")
    assert all(r["calls"] == 2 and r["median_ms"] > 0 for r in rows.values()), rows


def test_sample_channel_benchmark_smallest(tmp_path):
    """benchmarks/sample_channel.py at a toy batch, one repeat: both paths carry the batch
    (checked against what was sent inside the script), the tensor channel's bytes are fewer,
    and the table renders the run."""
    out = tmp_path / "s.jsonl"
    rows = _run("sample_channel.py", "--prompts", "2", "--group", "2", "--tokens", "8",
                "--multiturn", "--repeats", "1", "--out", str(out), "--work", str(tmp_path))
    assert [r["path"] for r in rows] == ["json_store", "tensor_gloo"]
    assert all(r["seconds"] > 0 and r["samples"] == 4 and "refused" not in r for r in rows)
    assert rows[1]["bytes"] < rows[0]["bytes"]
    assert "| 2 x 2 x 8 tokens, multi-turn |" in _bench_module("sample_channel").table(str(out))


def test_performance_doc_sample_channel_table_is_the_results():
    """docs/performance.md's sample channel table is sample_channel.py --table on the results
    file it names; the JSON path is refused by the store beyond its 8 MiB value limit; the
    columnar channel carried 10,000 samples x 4,096 tokens, its memory measured on both
    sides."""
    doc = ROOT / "docs" / "performance.md"
    marker = "<!-- sample channel table: generated by benchmarks/sample_channel.py --table"
    (path,) = between(doc, marker, "-->").split("--table", 1)[1].split()
    block = between(doc, marker, "<!-- end of sample channel table -->").split("-->\n", 1)[1]
    assert block.strip() == _bench_module("sample_channel").table(str(ROOT / path))
    rows = [json.loads(ln) for ln in (ROOT / path).read_text().splitlines() if ln.strip()]
    assert all(r["cpu"] and r["loadavg_1m"] >= 0 for r in rows)
    assert any("refused" in r for r in rows) and all(
        "seconds" in r for r in rows if r["path"] == "tensor_gloo")
    assert any(r["path"] == "tensor_gloo" and r.get("format") == "columns"
               and r["samples"] >= 10_000 and r["tokens"] >= 4096
               and r["training_memory_mb"]["VmHWM"] > 0 for r in rows)


def test_engine_process_benchmark_tiny(tmp_path):
    """benchmarks/engine_process.py at its smallest: the engine in a child process and in this
    one sample the same tokens from the same weights and seed, every figure is a positive
    time, and the table renders a row."""
    out = tmp_path / "e.jsonl"
    (row,) = _run("engine_process.py", "--sizes", "tiny", "--repeats", "1", "--out", str(out))
    assert row["tokens_equal"] and 0 < row["generated_tokens"] <= 8 * 4 * 16, row
    assert min(row["sync_s"], row["sync_s_child"], row["generate_s"],
               row["generate_s_child"]) > 0, row
    assert _bench_module("engine_process").table(str(out)).count("\n| tiny |") == 1


def test_resume_doc_engine_process_table_is_the_results():
    """docs/resume.md's cost table of rollout.engine_failure=continue is generated from
    benchmarks/results/engine_process_cpu.jsonl."""
    assert_generated_table(ROOT / "docs" / "resume.md",
                           "<!-- engine_process table: generated by",
                           "<!-- end of engine_process table -->",
                           _bench_module("engine_process").table(
                               str(BENCH / "results" / "engine_process_cpu.jsonl")))
