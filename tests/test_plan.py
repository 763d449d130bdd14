"""The memory planner's arithmetic against hand-computed numbers for a tiny config."""
import json
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from megagrpo.config.model import ModelConfig, ParallelConfig
from megagrpo.config.train import load_config
from megagrpo.plan import (
    GIB,
    layer_params,
    plan_model,
    rank_memory,
    run_plan,
    stage_params,
    suggest,
    total_params,
)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# vocab 100, H 8, F 16, 2 layers, 2 heads of width 4, 2 KV groups (valid at tp=1, 2)
TINY = ["model.vocab_size=100", "model.hidden_size=8", "model.ffn_hidden_size=16",
        "model.num_layers=2", "model.num_attention_heads=2", "model.num_query_groups=2",
        "model.head_dim=4", "parallel.make_vocab_size_divisible_by=8",
        "compute.micro_batch_size=2", "rollout.max_model_len=8", "data.batch_size=4"]


def tiny(**kw) -> ModelConfig:
    return ModelConfig(vocab_size=100, hidden_size=8, ffn_hidden_size=16, num_layers=2,
                       num_attention_heads=2, num_query_groups=2, head_dim=4, **kw)


def test_parameter_counts_by_hand():
    m = tiny()
    # qkv (2 + 2*2) * 4 * 8 = 192, proj 8 * 8 = 64, fc1 2 * 16 * 8 = 256, fc2 128, norms 2 * 8
    assert layer_params(m) == 192 + 64 + 256 + 128 + 16 == 656
    assert layer_params(m, tp=2) == 640 // 2 + 16 == 336
    assert layer_params(tiny(qkv_bias=True)) == 656 + 24
    # embedding 100 * 8, two layers, final norm, untied output layer
    assert total_params(m) == 800 + 2 * 656 + 8 + 800 == 2920
    assert total_params(tiny(tie_word_embeddings=True)) == 2920 - 800


def test_stage_params_by_hand():
    m = tiny()
    # tp=2: vocab padded to a multiple of 8 * 2 -> 112, 56 rows per rank
    tp2 = ParallelConfig(tp=2, make_vocab_size_divisible_by=8)
    assert stage_params(m, tp2, 0) == 2 * 336 + 56 * 8 + 8 + 56 * 8 == 1576
    # pp=2: vocab padded to 104; embedding on stage 0, final norm + output layer on stage 1
    pp2 = ParallelConfig(pp=2, make_vocab_size_divisible_by=8)
    assert stage_params(m, pp2, 0) == 656 + 104 * 8 == 1488
    assert stage_params(m, pp2, 1) == 656 + 8 + 104 * 8 == 1496
    # tied: one copy on a single stage, a copy on the last stage under PP (as megatron keeps)
    mt = tiny(tie_word_embeddings=True)
    assert stage_params(mt, ParallelConfig(make_vocab_size_divisible_by=8), 0) == 2 * 656 + 832 + 8
    assert stage_params(mt, pp2, 1) == 1496


def test_rank_bytes_by_hand():
    cfg = load_config(None, TINY + ["parallel.tp=2", "model.dtype=bfloat16",
                                    "optim.distributed_optimizer=true"])
    r = rank_memory(cfg, cfg.model, 2, 1, world=4, gpu_mem_gib=1.0)
    n = 1576
    assert (r.dp, r.params) == (2, n)
    assert r.weights == 2 * n and r.grads == 4 * n
    assert r.optimizer == 12 * n // 2  # m, v, fp32 master; sharded over dp=2
    assert r.reference == 2 * n  # algo.beta > 0 by default
    # T = 2 x 8 = 16 rows, local vocab 56 in bf16. The fused output layer (default): one
    # chunk of logits (all 16 x 56 here), fp32 accumulators of dh [T, h] and of a dW chunk
    # [56, h]; fp32 stats [T, 4], their all-gather [2T, 4] and three [T] rows
    stats = 16 * 4 * (4 + 8 + 3)
    assert r.fused_output
    assert r.logits_fused == 16 * 56 * 2 + (16 * 8 + 56 * 8) * 4 + stats == 5056
    assert r.logits_naive == 16 * 100 * (2 + 3 * 4) == 22400
    # s*b tokens x 129 values a layer (megagrpo.plan.layer_values at tp 2: norms 6h + RoPE's
    # 4 x head_dim, q 4 + k 4 + fused QKV 12 + output 4 + lse 1, SwiGLU 5 x 16 / 2), 2 bytes,
    # 2 layers on the one stage
    assert r.activations == 8 * 2 * (48 + 16 + 25 + 40) * 2 * 2 == 8256
    assert r.vllm == GIB // 2 and not r.vllm_sleeps
    assert r.total == r.update_peak == r.state + 5056 + 8256 + GIB // 2
    # the logits path: the logits [T, V/tp] once (gradient in place) + the stats
    cfg.compute.fused_output_layer = False
    r = rank_memory(cfg, cfg.model, 2, 1, world=4, gpu_mem_gib=1.0)
    assert not r.fused_output and r.logits_fused == 16 * 56 * 2 + stats == 2752


def test_fused_output_layer_holds_a_chunk_not_the_logits():
    """Qwen's vocab at 16k tokens per micro-batch (the issue's example): the logits path holds
    [T, V] (4.6 GiB bf16 at TP=1); the fused layer one 32M-value chunk + fp32 accumulators."""
    over = ["model.vocab_size=151936", "model.hidden_size=1024", "model.dtype=bfloat16",
            "compute.micro_batch_size=16", "rollout.max_model_len=1024"]
    cfg = load_config(None, TINY + over)
    fused = rank_memory(cfg, cfg.model, 1, 1, world=1, gpu_mem_gib=80.0).logits_fused
    cfg.compute.fused_output_layer = False
    logits = rank_memory(cfg, cfg.model, 1, 1, world=1, gpu_mem_gib=80.0).logits_fused
    t = 16 * 1024
    assert logits > t * 151936 * 2
    assert fused < 0.05 * logits


@pytest.mark.parametrize("extra,field,expected", [
    (["optim.distributed_optimizer=false", "model.dtype=bfloat16"], "optimizer", 12 * 1576),
    (["optim.distributed_optimizer=false"], "optimizer", 8 * 1576),  # fp32: no master copy
    (["algo.beta=0"], "reference", 0),
    (["reference.offload=true"], "reference", 0),
    (["compute.inplace_backward=false", "compute.fused_output_layer=false"], "logits_fused",
     2 * 16 * 56 * 4 + 960),
    (["parallel.transformer_impl=local", "parallel.attention_impl=megatron"], "activations",
     4 * 2 * (8 * 2 * 129 + 2 * 8 * 8 * 2 // 2)),  # fp32, + the scores a s^2 b / tp
])
def test_switches(extra, field, expected):
    cfg = load_config(None, TINY + ["parallel.tp=2"] + extra)
    assert getattr(rank_memory(cfg, cfg.model, 2, 1, world=4, gpu_mem_gib=1.0), field) == expected


def test_sleeping_vllm_leaves_the_update_phase():
    cfg = load_config(None, TINY + ["rollout.sleep_between_rollouts=true"])
    r = rank_memory(cfg, cfg.model, 1, 1, world=1, gpu_mem_gib=1.0)
    assert r.update_peak == r.state + r.logits_fused + r.activations
    assert r.total == max(r.update_peak, r.rollout_peak) == r.state + GIB // 2


def test_suggest_prefers_data_parallel_then_fewer_stages():
    cfg = load_config(None, TINY)
    fits = suggest(cfg, cfg.model, world=4, gpu_mem_gib=1.0)
    # tp=4 does not divide 2 heads; every tp x pp divides the world and dp divides the batch
    assert [(r.tp, r.pp, r.dp) for r in fits] == [(1, 1, 4), (2, 1, 2), (1, 2, 2), (2, 2, 1)]
    # ~10 KiB per GPU: the fp32 training state alone (~45 KiB at tp=1) does not fit
    assert suggest(cfg, cfg.model, world=4, gpu_mem_gib=1e-5) == []


def test_real_model_counts():
    """Published sizes: Qwen2.5-0.5B has 494,032,768 parameters, Llama-3-8B 8,030,261,248."""
    qwen = load_config(str(EXAMPLES / "qwen2.5-0.5b-gsm8k.yaml")).model
    llama = load_config(str(EXAMPLES / "llama3-8b-math.yaml")).model
    assert total_params(qwen) == 494_032_768
    assert total_params(llama) == 8_030_261_248


def test_model_from_hf_config_json(tmp_path):
    from megagrpo.hf import hf_config_dict

    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(tiny())))
    cfg = load_config(None, [f"run.init={tmp_path}"])
    m, source = plan_model(cfg)
    assert total_params(m) == 2920 and source.endswith("config.json")


def test_cli_prints_the_table(capsys):
    assert run_plan(None, TINY, gpus=4, gpu_mem_gib=1.0) == 0
    out = capsys.readouterr().out
    assert "suggested: parallel.tp=1 parallel.pp=1 (dp=4)" in out
    assert "naive fp32 log_softmax" in out
    assert run_plan(None, TINY, gpus=4, gpu_mem_gib=1e-5) == 1
    assert "no valid tp x pp over 4 GPU(s) fits" in capsys.readouterr().out


def test_plan_measures_which_dtype_is_faster_on_this_cpu(capsys):
    """Planning for this machine (no --gpus) ends with fp32 and bf16 torch.mm rates measured
    now and the dtype that trains faster here, consistent with the measured ratio (AVX2-only
    CPUs run bf16 ~70x slower, AVX-512 + avx512_bf16 ones ~3-4x faster)."""
    run_plan(None, TINY)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    m = re.search(r"torch capability (\w+).*fp32 ([\d.]+) GFLOP/s .*bf16 ([\d.]+) GFLOP/s .*"
                  r"bf16/fp32 = ([\d.]+)x: the faster training dtype here is (\w+)", line)
    assert m, line
    assert m.group(1) == torch.backends.cpu.get_cpu_capability()
    fp32, bf16, ratio = float(m.group(2)), float(m.group(3)), float(m.group(4))
    assert fp32 > 0 and bf16 > 0 and ratio == pytest.approx(bf16 / fp32, rel=0.02, abs=0.01)
    assert m.group(5) == "float32"  # TINY is under SMALL_MODEL_PARAMS: fp32 either way
    if ratio > 1.2:
        assert "per-op overhead" in line


def test_dtype_advice_follows_the_rate_for_a_large_model(capsys):
    """For a 135M-parameter model the advice follows the measured matmul ratio alone."""
    from megagrpo.runtime.machine import dtype_advice

    line = dtype_advice(params=135_000_000)
    ratio = float(re.search(r"bf16/fp32 = ([\d.]+)x", line).group(1))
    assert line.split("the faster training dtype here is ")[1].split()[0] == (
        "bfloat16" if ratio > 1.2 else "float32")
    # bf16 advice carries the accuracy caveat measured on the SmolLM2 recipe
    assert ("drop updates below their rounding step" in line) == (ratio > 1.2)


def _all_cpus_busy() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs, read here from /proc/stat (not megagrpo's reader)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    busy = v[0] + v[1] + v[2] + v[5] + v[6] + v[7]  # user nice system irq softirq steal
    return busy, busy + v[3] + v[4]  # + idle iowait


def test_busy_cores_sees_a_busy_process_and_not_its_own_work():
    """A process spinning on one core is seen as about one core's worth of other load, while
    this process keeps another core busy itself over the window: what is reported is all the
    CPUs' load less this process's own share, measured here on its own (any core count); the
    start-up note appears above BUSY_NOTE_CORES only, naming the cores."""
    import subprocess
    import sys
    import time

    from megagrpo.runtime.machine import BUSY_NOTE_CORES, busy_cores_since, busy_note, cpu_sample

    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        start = cpu_sample()
        (b0, t0), own0, wall0 = _all_cpus_busy(), time.process_time(), time.monotonic()
        # this process's own work over the window: 0.25 CPU seconds however long the
        # neighbours make that take (on a loaded machine its share is small but measured)
        while time.process_time() < own0 + 0.25 and time.monotonic() < wall0 + 20:
            pass
        busy = busy_cores_since(start)
        (b1, t1), own1, wall1 = _all_cpus_busy(), time.process_time(), time.monotonic()
    finally:
        spin.kill()
        spin.wait()
    cores = os.cpu_count() or 1
    own = (own1 - own0) / (wall1 - wall0)
    every = (b1 - b0) / max(t1 - t0, 1) * cores
    # counting its own work would be off by `own`: the tolerance (a jiffy or two of the
    # window) stays below that
    assert busy == pytest.approx(max(0.0, every - own), abs=min(0.05, own / 2)), (busy, every,
                                                                                 own)
    assert 0.7 < busy <= cores + 0.05, busy
    assert "of this machine's 2 cores" in busy_note(busy, cores=2)
    assert busy_note(BUSY_NOTE_CORES - 0.01) is None


def shared_job(work):
    """This module's part of the shared 4-rank launch (tests/conftest.py): this file as the
    worker."""
    return [__file__], None


def test_stage_params_match_megatron_at_tp2_pp2(shared_launch):
    """The planner's per-rank counts equal the parameters of the GPTModel stage each of 4 real
    ranks builds (tied embeddings + QKV bias: the last stage's embedding copy, the bias split)."""
    from tests.support.launch import shared_output

    out = shared_output(shared_launch[__name__][0], 4)
    counts = {int(r): (int(n), int(s)) for r, n, s in re.findall(r"rank (\d) params (\d+) (\d+)",
                                                                  out)}
    assert len(counts) == 4
    m = _worker_model()
    for n, pp_rank in counts.values():
        assert n == stage_params(m, _worker_parallel(), pp_rank)


def _worker_model() -> ModelConfig:
    return ModelConfig(architecture="qwen2", vocab_size=100, hidden_size=64, ffn_hidden_size=96,
                       num_layers=4, num_attention_heads=4, num_query_groups=2, head_dim=16,
                       qkv_bias=True, tie_word_embeddings=True)


def _worker_parallel() -> ParallelConfig:
    return ParallelConfig(tp=2, pp=2, make_vocab_size_divisible_by=8)


if __name__ == "__main__":  # the worker of the test above, one per rank (run_ranks)
    from megagrpo.model.gpt import build_model
    from megagrpo.runtime.distributed import init_distributed, shutdown

    info = init_distributed(_worker_parallel(), _worker_model())
    gpt = build_model(_worker_model(), _worker_parallel())
    n = sum(p.numel() for p in gpt.parameters())
    print(f"rank {info.rank} params {n} {info.pp_rank}", flush=True)
    shutdown()


def test_vllm_tp_weights_and_kv_cache_by_hand():
    from megagrpo.plan import vllm_rank_bytes

    m = tiny()
    # 2920 params, of which 5 norms of 8 stay whole on every rank; fp32
    assert vllm_rank_bytes(m, 1, "float32") == (2920 * 4, 2 * 2 * 2 * 4 * 4)
    assert vllm_rank_bytes(m, 2, "float32") == ((2880 // 2 + 40) * 4, 2 * 2 * 1 * 4 * 4)
    # k above the 2 KV heads: vLLM replicates them, one head per rank
    m4 = replace(tiny(), num_attention_heads=4)
    assert vllm_rank_bytes(m4, 4, "bfloat16")[1] == 2 * 2 * 1 * 4 * 2
    cfg = load_config(None, TINY + ["rollout.tensor_parallel_size=2"])
    r = rank_memory(cfg, cfg.model, 1, 1, world=4, gpu_mem_gib=1.0)
    assert r.vllm_tp == 2 and r.kv_cache == GIB // 2 - (2880 // 2 + 40) * 4
    assert r.kv_tokens == r.kv_cache // 64


def test_recommended_vllm_tp_is_the_smallest_with_room_for_a_group():
    from megagrpo.plan import recommend_vllm_tp

    # 72B in bf16 on 139 GiB GPUs: vLLM's 35% share cannot hold 1/2 of the weights (68 GiB);
    # at k=4 (36 GiB of weights) it still holds 16 x 3072 tokens of KV cache; 3 divides no head
    cfg = load_config(str(EXAMPLES / "qwen2.5-72b-math.yaml"))
    m = cfg.model
    for k, room in ((1, False), (2, False), (4, True)):
        r = rank_memory(cfg, m, 8, 2, world=16, gpu_mem_gib=139.0, vllm_tp=k)
        assert (r.kv_tokens >= 16 * 3072) == room, (k, r.kv_cache / GIB)
    assert recommend_vllm_tp(cfg, m, 16, 139.0) == 4
    assert recommend_vllm_tp(cfg, m, 16, 20.0) is None  # 7 GiB share: not even k=16 has room


def test_70b_recipe_validates_and_plans_without_weights(capsys):
    cfg = load_config(str(EXAMPLES / "qwen2.5-72b-math.yaml"))
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.rollout.tensor_parallel_size) == (8, 2, 8)
    cfg.validate(world_size=16)
    assert round(total_params(cfg.model) / 1e9, 1) == 72.7  # Qwen2.5-72B's published size
    assert run_plan(str(EXAMPLES / "qwen2.5-72b-math.yaml"), [], gpus=16, gpu_mem_gib=139) == 0
    out = capsys.readouterr().out
    assert "is not on this machine" in out and "vLLM engines of 8 rank(s)" in out
    assert "of which vLLM weights (1/8 of the model)" in out
    assert run_plan(str(EXAMPLES / "qwen2.5-72b-math.yaml"), [], gpus=16, gpu_mem_gib=80) == 1


def test_vl_7b_recipe_plans_with_the_vision_tower_counted(capsys):
    """examples/qwen2.5-vl-7b-geometry.yaml validates at 8 ranks and plans on 8 x 80 GiB without
    weights. Its parameters are Qwen2.5-VL-7B's published 8,292,166,656: Qwen2.5-7B's
    7,615,616,512 plus the tower counted by hand (patch embedding 3*2*14*14*1280; 32 blocks of
    two norms, QKV, projection and a gated MLP of 3420 with biases; the merger's norm and
    5120 -> 5120 -> 3584 MLP). Each TP rank holds the whole (replicated) tower on top of a
    text model's share, and the frozen tower adds weights only: no gradient, no Adam state."""
    from megagrpo.plan.memory import vision_params

    path = str(EXAMPLES / "qwen2.5-vl-7b-geometry.yaml")
    cfg = load_config(path)
    cfg.validate(world_size=8)
    m = cfg.model
    block = 2 * 1280 + (1280 * 3840 + 3840) + (1280 * 1280 + 1280) \
        + 2 * (1280 * 3420 + 3420) + (3420 * 1280 + 1280)
    tower = 3 * 2 * 14 * 14 * 1280 + 32 * block + 1280 + (5120 * 5120 + 5120) \
        + (5120 * 3584 + 3584)
    assert vision_params(m) == tower == 676_550_144
    assert total_params(m) == 8_292_166_656 == 7_615_616_512 + tower
    text = replace(m, architecture="qwen2", vision=None, mrope_section=[])
    vl, lm = (rank_memory(cfg, x, 4, 1, world=8, gpu_mem_gib=80.0) for x in (m, text))
    assert vl.params - lm.params == tower
    assert vl.weights - lm.weights == 2 * tower  # bf16
    assert (vl.grads, vl.optimizer) == (lm.grads, lm.optimizer)
    assert run_plan(path, [], gpus=8, gpu_mem_gib=80) == 0
    out = capsys.readouterr().out
    assert "qwen2_5_vl, 8292.2M params" in out and "fits: yes" in out
