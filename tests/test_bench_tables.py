"""The benchmarks' table generators on one synthetic row each, against the row written out by
hand (ratios, percentages and rounding computed here, not by the generator): the doc checks
compare a generator with itself on the committed results, which a wrong ratio passes."""
import json
from pathlib import Path

from tests.support.bench import bench_module as _bench_module


def _jsonl(tmp_path, *rows) -> str:
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_multiturn_table(tmp_path):
    row = {"workload": "calc", "mode": "async", "turns": 2.5, "tool_calls": 1.5,
           "model_tokens_per_traj": 30.3, "env_tokens_per_traj": 10.04, "step_s": 4.0,
           "rollout_s": 1.0, "model_tokens_per_s": 242.4, "env_tokens_per_s": 80.3,
           "tool_share": 0.125, "loadavg_1m_start": 1.0, "loadavg_1m_end": 3.5,
           "cpu": "CPU X", "cores": 2, "nproc": 2}
    lines = _bench_module("multiturn").table(Path(_jsonl(tmp_path, row))).splitlines()
    assert lines[2] == ("| calc | async | 2.50 | 1.50 | 30.3 | 10.0 | 4.00 | 1.00 | 242 | 80 "
                        "| 12.5% |")
    assert lines[-1] == "CPU X, 2 cores, 2 ranks; 1-minute load average 1.0-3.5 during the runs."


def test_weight_sync_table(tmp_path):
    row = {"size": "tiny", "bytes": 3.2e6, "sync_s": 0.5, "disk_total_s": 2.0, "memcpy_s": 0.1,
           "engine_load_s": 0.25, "repack_s": 0.3, "plain_copy_s": 0.2, "decode_plain_s": 1.5,
           "decode_packed_s": 1.0}
    lines = _bench_module("weight_sync").table(_jsonl(tmp_path, {"other": 1}, row)).splitlines()
    assert lines[2:] == ["| tiny | 3 MB | 0.500 | 2.000 | 4.00x | 5.0x | 0.250 | 0.300 | 0.200 "
                         "| 3.0x | 1.50x |"]


def test_weight_sync_separate_table(tmp_path):
    row = {"size": "tiny", "params": 2.5e6, "layout": "train tp=2 -> 1 rollout rank",
           "model_bytes": 1e7, "full_bytes": 1.2e7, "delta, all changed_bytes": 1.2e7,
           "delta, linears changed_bytes": 8e6, "adapter_bytes": 5e5, "full_s": 0.5,
           "delta, all changed_s": 0.6, "delta, linears changed_s": 0.4, "adapter_s": 0.01,
           "colocated full_s": 0.25, "colocated adapter_s": 0.02, "broadcast_full_s": 0.2,
           "broadcast_adapter_s": 0.004, "peak_train_mib": 64.4, "peak_rollout_mib": 130.6}
    lines = _bench_module("weight_sync").separate_table(_jsonl(tmp_path, {"size": "x"}, row)
                                                         ).splitlines()
    m = "| tiny (2.5M, train tp=2 -> 1 rollout rank) |"
    assert lines[2:] == [
        f"{m} colocated, full tensors (TP gather) | 10 MB | 0.2500 | 0.04 |  |  |",
        f"{m} colocated, adapter (peft folder) | 0.5 MB | 0.0200 | 0.025 |  |  |",
        f"{m} separate, full (shard to shard) | 12 MB | 0.5000 | 0.024 | 0.2000 (2.5x) "
        "| 64 / 131 |",
        f"{m} separate, delta, all changed | 12 MB | 0.6000 | 0.02 |  |  |",
        f"{m} separate, delta, linears changed | 8 MB | 0.4000 | 0.02 |  |  |",
        f"{m} separate, adapter | 0.5 MB | 0.0100 | 0.05 | 0.0040 (2.5x) |  |"]


def test_lora_decode_table_groups_a_run_from_its_merged_row(tmp_path):
    first = {"model": "/m/SmolLM2-135M", "rank": 8, "prompts": 4, "new_tokens": 256,
             "cpu": "EPYC", "cpu_capability": "avx2", "threads": 2, "load_avg": 1.5}
    rows = [dict(first, mode="merged", tokens_per_s=400.4),
            dict(first, mode="adapter", tokens_per_s=100.0, vs_merged=0.25),
            dict(first, mode="base", tokens_per_s=380.0, vs_merged=0.949),
            dict(first, mode="merged", tokens_per_s=50.0, rank=16)]
    lines = _bench_module("lora_decode").table(_jsonl(tmp_path, *rows)).splitlines()
    assert lines[2:] == [
        "| SmolLM2-135M, r8, 4 x 64 tokens | EPYC (avx2, 2 threads) | 1.5 | 400 | 100 (0.25x) "
        "| 380 (0.95x) |",
        "| SmolLM2-135M, r16, 4 x 64 tokens | EPYC (avx2, 2 threads) | 1.5 | 50 |  |  |"]


def test_rollout_settings_table(tmp_path):
    row = {"variant": "a", "overrides": ["rollout.max_num_seqs=32"],
           "env": {"OMP_NUM_THREADS": "2"}, "best_s": 1.5, "median_s": 2.0,
           "gen_tokens_per_s": 512.6, "floor_frac": 0.4567, "gemm_gflops": 100.0,
           "mem_read_gbs": 20.0, "loadavg_1m": 1.0}
    plain = dict(row, variant="b", overrides=[], env={})
    lines = _bench_module("rollout_settings").table(
        _jsonl(tmp_path, {"machine": 1}, row, plain)).splitlines()
    assert lines[2:] == [
        "| a | rollout.max_num_seqs=32, OMP_NUM_THREADS=2 | 1.500 s | 2.000 s | 513 | 45.7% "
        "| 100 GFLOP/s / 20 GB/s | 1.00 |",
        "| b | the workload as is | 1.500 s | 2.000 s | 513 | 45.7% | 100 GFLOP/s / 20 GB/s "
        "| 1.00 |"]


def test_moe_routing_table(tmp_path):
    row = {"dtype": "bf16", "cpu": "X", "tokens_compared": 100, "routing_mismatch_pairs": 0.0123,
           "routing_mismatch_tokens": 0.05, "logp_gap_mean": 1.5e-3, "logp_gap_max": 0.02,
           "logp_gap_mean_same_routing": 1e-6, "logp_gap_mean_replayed": 2e-7,
           "logp_gap_max_replayed": 3e-6}
    lines = _bench_module("moe_routing").table(_jsonl(tmp_path, row)).splitlines()
    assert lines[2:] == ["| bf16 | X | 100 | 1.23% | 5.00% | 1.50e-03 / 2.00e-02 | 1.00e-06 "
                         "| 2.00e-07 / 3.00e-06 |"]


def test_rollout_floor_table_keeps_the_newest_record_per_workload(tmp_path):
    row = {"system": "megagrpo", "workload": "tiny", "dtype": "float32", "nproc": 2,
           "mem_read_gbs": 12.34, "time_rollout_s": 2.0, "floor_rollout_flops_only_s": 0.5,
           "floor_rollout_s": 1.0, "floor_frac_rollout": 0.5, "rollout_decode_flop_s": 0.25,
           "rollout_decode_byte_s": 0.75, "rollout_decode_steps": 10,
           "rollout_bandwidth_bound_steps": 4, "gemm_gflops": 99.6, "loadavg_1m": 1.5}
    older = dict(row, time_rollout_s=9.0)
    lines = _bench_module("rollout_floor").table(
        _jsonl(tmp_path, older, dict(row, system="trl"), row)).splitlines()
    assert lines[2:] == [
        "| tiny | float32 | 2 | 2.000 s | 0.500 s (25.0%) | 1.000 s (50.0%) | 0.250 / 0.750 s "
        "| FLOPs on 6, bandwidth on 4 of 10 decode steps | 100 GFLOP/s | 12.3 GB/s | 1.50 |"]


def test_kernels_table(tmp_path):
    rows = [{"check": "grads vs float64", "ok": True},
            {"V_local": 1024, "path": "triton", "fwd_bwd_s": 0.00125, "peak_extra_pct": 12.34,
             "frac_of_copy": 0.456, "T": 4096, "dtype": "bf16", "device": "H200"},
            {"V_local": 512, "path": "torch", "fwd_bwd_s": 0.004, "peak_extra_pct": 200.0,
             "T": 4096, "dtype": "bf16", "device": "H200"}]
    lines = _bench_module("kernels").table(_jsonl(tmp_path, *rows)).splitlines()
    assert lines[2:] == [
        "| 1024 | triton | 1.25 ms | 12.3% | 46% |", "| 512 | torch | 4.00 ms | 200.0% | - |", "",
        "T = 4096 tokens, bf16, on H200; V_local = V/tp stands for TP = 1, 2, 4 on one device; "
        "float64 check: grads vs float64, passed."]


def test_lora_memory_table(tmp_path):
    mib = 2**20
    common = {"workload": "tiny", "params": 1_000_000, "dtype": "float32", "cpu": "X",
              "threads": 2, "seq": 64, "repeats": 3, "reference_bytes": 0}
    full = dict(common, mode="full", trainable=1_000_000, memory_per_rank_bytes=16 * mib,
                weights_bytes=4 * mib, grad_buffer_bytes=4 * mib, opt_state_bytes=8 * mib,
                refit_full_bytes=4 * mib, refit_full_s=0.1, step_s=0.2, loadavg_1m=1.0)
    lora = dict(common, mode="lora", lora_rank=8, lora_targets=["qkv", "proj"],
                trainable=10_000, memory_per_rank_bytes=4 * mib, weights_bytes=4 * mib,
                grad_buffer_bytes=mib // 2, opt_state_bytes=mib, refit_adapter_bytes=mib // 64,
                refit_after_merge_bytes=4 * mib + mib // 64, refit_merged_bytes=4 * mib,
                refit_adapter_s=0.01, refit_after_merge_s=0.11, refit_merged_s=0.1, step_s=0.1,
                loadavg_1m=2.5)
    stale = dict(full, weights_bytes=1)  # an older line of the same (workload, mode)
    text = _bench_module("lora_memory").table(_jsonl(tmp_path, stale, full, lora))
    assert text.splitlines() == [
        "**tiny** (1,000,000 parameters, float32, LoRA rank 8 on qkv,proj; X, 2 thread(s), "
        "load average 1.00 / 2.50, seq 64, median of 3)", "",
        "| | full | LoRA | LoRA / full |", "|---|---|---|---|",
        "| trainable parameters | 1,000,000 | 10,000 | 1.0% |",
        "| memory per rank (weights + grads + Adam + reference) | 16.00 MiB | 4.00 MiB | 25.0% |",
        "| weights | 4.00 MiB | 4.00 MiB | 100.0% |",
        "| DDP grad buffers (fp32) | 4.00 MiB | 0.50 MiB | 12.5% |",
        "| Adam state | 8.00 MiB | 1.00 MiB | 12.5% |",
        "| reference copy | 0 | 0 | - |",
        "| refit bytes per step, between merges (adapters) | 4.00 MiB | 0.02 MiB | 0.4% |",
        "| refit bytes, step after a merge (base + adapters) | 4.00 MiB | 4.02 MiB | 100.4% |",
        "| refit bytes per step, merged fallback | 4.00 MiB | 4.00 MiB | 100.0% |",
        "| refit time per step, between merges (trainer side) | 100.0 ms | 10.0 ms | 10.0% |",
        "| refit time, step after a merge | 100.0 ms | 110.0 ms | 110.0% |",
        "| refit time per step, merged fallback | 100.0 ms | 100.0 ms | 100.0% |",
        "| step time (fwd + bwd + Adam, 1 x seq tokens) | 200.0 ms | 100.0 ms | 50.0% |", "",
        "Refit bytes between merges: 0.39% of full fine-tuning's (target <= 2%: met)."]


def test_layer_split_compiled_table_pairs_each_compiled_row_with_the_faster_eager_one(tmp_path):
    shapes = {"hidden": 64, "ffn": 128, "layers": 2}
    eager = {"preset": "tiny", "shapes": shapes, "threads": 1, "neighbour_threads": 0,
             "tokens": 32, "dtype": "float32", "rest_share": 0.25, "floor_frac": 0.1}
    compiled = dict(eager, step_s=0.15, load_avg_1m=1.5, rest_s=0.02, rest_share=0.1333,
                    floor_frac=0.125,
                    compiled={"graphs": 1.0, "compile_s": 12.3, "grad_max_rel_diff": 3.2e-7})
    rows = [dict(eager, step_s=0.2, load_avg_1m=1.0, rest_s=0.07),
            compiled,
            dict(eager, step_s=0.18, load_avg_1m=2.0, rest_s=0.05),  # the faster eager row
            dict(compiled, neighbour_threads=2),  # beside a busy process: not compared
            dict(compiled, preset="other")]  # no eager row of its shapes: left out
    lines = _bench_module("layer_split").compiled_table(_jsonl(tmp_path, *rows)).splitlines()
    assert lines[2:] == [
        "| tiny (h 64, ffn 128, 2 layers, 32 tokens, float32) | 1 | 1.0/2.0 / 1.5 | 200 / 180 ms "
        "| 150 ms | 0.83x | 50 -> 20 ms (25% -> 13%) | 10.0% -> 12.5% | 2 | 12.3 s | 3.2e-07 |"]


def test_tools_demo_table_windows(tmp_path):
    """12 steps: the first and last WINDOW = 5 steps' means, by hand."""
    summary = {"eval_accuracy_init": 0.01, "eval_accuracy_before": 0.25,
               "eval_accuracy_after": 0.875, "steps": 12, "sft_steps": 40, "sft_seconds": 90.0,
               "wall_seconds": 600.0}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    steps = [{"step": k, "reward_mean": k / 10, "tool_calls": 2, "tool_errors": int(k <= 5)}
             for k in range(1, 13)]
    _jsonl(tmp_path, {"step": 6, "eval_accuracy": 0.5}, *steps)
    (tmp_path / "r.jsonl").rename(tmp_path / "metrics.jsonl")
    lines = _bench_module("tools_demo_report").table(tmp_path).splitlines()
    assert lines[2:] == [
        "| held-out accuracy (greedy): initial weights -> after the cold start | 0.010 | 0.250 |",
        "| held-out accuracy: before -> after 12 GRPO steps | 0.250 | 0.875 |",
        "| sampled trajectories (steps 1-5 -> steps 8-12): reward | 0.300 | 1.000 |",
        "| well-formed tool calls per trajectory | 1.000 | 2.000 |",
        "| malformed tool calls per trajectory | 1.000 | 0.000 |",
        "| steps: cold start -> GRPO | 40 | 12 |",
        "| wall time of the run (minutes): cold start -> all | 1.5 | 10.0 |"]


def test_gpu_step_table_orders_and_keeps_the_newest_row(tmp_path):
    base = {"bench": "gpu_step", "processed_tokens": 1024, "update_s": 0.25,
            "tflops_update": 123.4, "mfu_update": 0.126, "score_s": 0.1, "tflops_score": 50.0,
            "mfu_score": 0.05, "tokens_per_s_update": 4096.0, "tokens_per_s_score": 10240.0,
            "peak_gib_update": 12.34, "peak_gib_score": 5.0, "compile_s": 0.0,
            "loss_rel_diff": 1.5e-3, "grad_rel_diff": 2e-2, "device": "H200", "torch": "2.9",
            "dtype": "bf16", "params": 1.5e9, "rows": 8, "seq": 512, "real_tokens": 3000,
            "loss_tokens": 2000, "mm_tflops": 700.4, "mm_n": 8192, "layer_spec": "local",
            "attention": "sdpa"}

    def row(compile_layers, layout, output, **kw):
        return dict(base, compile_layers=compile_layers, layout=layout, output=output, **kw)

    rows = [row(False, "packed", "logits"), row(True, "padded", "fused", update_s=9.0),
            row(False, "padded", "fused"), {"bench": "other"},
            row(True, "padded", "fused", compile_s=12.6),
            {"bench": "gpu_step", "compile_layers": True, "layout": "packed", "output": "logits",
             "error": "OOM"}]
    figures = "250 ms | 123 (13%) | 100 ms | 50 (5%) | 4096 / 10240 | 12.3 / 5.0"
    lines = _bench_module("gpu_step").table(_jsonl(tmp_path, *rows)).splitlines()
    assert lines[2:] == [
        f"| off | padded (1024 tokens) | fused | {figures} | - | 1.5e-03 / 2.0e-02 |",
        f"| off | packed (1024 tokens) | logits | {figures} | - | 1.5e-03 / 2.0e-02 |",
        f"| on | padded (1024 tokens) | fused | {figures} | 13 s | 1.5e-03 / 2.0e-02 |",
        "| on | packed | logits | failed: OOM | | | | | | | |", "",
        "H200, torch 2.9, bf16, 1.50B parameters, 8 rows of up to 512 tokens (3000 real, 2000 "
        "loss tokens); torch.mm 700 TFLOP/s at 8192^3; local layer spec, sdpa attention."]


def test_demo_seeds_table_rows_and_spread(tmp_path):
    """Two seeds of one tag (one reached the target, one hit the cap), seed 10 sorted after 2."""
    bench = _bench_module("demo_seeds_report")
    tag = "compiled-epyc25"
    runs = {2: ({"sft_steps": 50, "sft_eval_accuracy": 0.3125, "steps": 120,
                 "eval_target_step": 120, "eval_target_accuracy": 0.92,
                 "eval_accuracy_after": 0.9375},
                {"wall_seconds_command": 605.4, "load_mean": 3.04}),
            10: ({"sft_steps": 100, "sft_eval_accuracy": 0.3, "steps": 600,
                  "eval_target_accuracy": 0.92, "eval_accuracy_after": 0.875},
                 {"wall_seconds_command": 3599.6, "load_mean": 5.26})}
    for seed, (summary, run) in runs.items():
        (tmp_path / f"seed{seed}-{tag}-summary.json").write_text(json.dumps(summary))
        (tmp_path / f"seed{seed}-{tag}-run.json").write_text(json.dumps(run))
    cpu = bench.TAGS[tag]
    lines = bench.table(tmp_path).splitlines()
    assert lines[2:] == [
        f"| {cpu} | 2 | 50 -> 0.312 | 120 (reached 0.92) | 0.938 | 10 min 05 s (3.0) |",
        f"| {cpu} | 10 | 100 -> 0.300 | 600 (cap; 0.92 not reached) | 0.875 | 60 min 00 s (5.3) |",
        f"| {cpu} | spread | | | 0.875 - 0.938 | 10 min 05 s - 60 min 00 s |"]


def test_fused_output_fit_table(tmp_path):
    fit = {"fit": True, "fixed_bytes": 10 * 2**20}
    rows = [dict(fit, budget_gib=8, path="fused", bytes_per_token=1_234_567,
                 fixed_bytes=3 * 2**20, max_tokens=5000, tokens_vs_logits_path=2.5),
            dict(fit, budget_gib=8, path="logits", bytes_per_token=1, max_tokens=1),  # older
            {"path": "logits", "T": 1},  # a timing row: not a fit line
            dict(fit, budget_gib=8, path="logits", bytes_per_token=3e6, max_tokens=2000),
            dict(fit, budget_gib=4, path="logits", bytes_per_token=3e6, max_tokens=900)]
    lines = _bench_module("fused_output").fit_table(_jsonl(tmp_path, *rows)).splitlines()
    assert lines == ["| (a) logits | 3.000 MB | 10 MiB | 900 tokens |",
                     "| (a) logits | 3.000 MB | 10 MiB | 2000 tokens |",
                     "| (b) fused output layer | 1.235 MB | 3 MiB | 5000 tokens (2.50x) |"]
