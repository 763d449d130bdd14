"""Qwen3 (QK-norm, explicit head_dim) and Llama-3.1 (llama3 RoPE scaling) end to end, against
transformers' own models built from their config classes (tests/support/tiny.py):

- config.json -> ModelConfig -> config.json, and every unsupported feature refused naming its
  key before compute (CLI exit 2, no process group), a Qwen3 checkpoint lacking a q_norm too;
- `megagrpo verify` in one 2-rank launch: passes at TP=1 for both families and at a split
  (Qwen3 TP=2 on a GRPO-trained export, Llama-3.1 PP=2), with prompts up to 512 positions and
  the bitwise HF -> megatron -> HF round trip at that layout; fails (exit 1) with a broken k/v
  mapping;
- llama3 scaling matters where verify looks (transformers with and without it differ by orders
  of magnitude more than verify's tolerance); vLLM applies it (heavy);
- a 2-step GRPO run with vLLM on Qwen3 (reference reset every step, vLLM-vs-trainer log-prob
  gap) whose export loads in transformers; HF -> megatron TP=2 -> HF via convert (heavy).
"""
from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from megagrpo.config.model import ModelConfig
from megagrpo.config.train import load_config
from megagrpo.hf import hf_config_dict, hf_shapes, model_config_from_hf, param_specs
from megagrpo.plan import layer_params
from tests.support.cli import run_cli
from tests.support.tiny import LLAMA3_ROPE, edited_copy, load_dir, tiny_dirs

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "examples" / "demo.yaml")
LONG = "512"  # verify's longest prompt for Llama-3.1: well past where the scaling shows


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    return tiny_dirs(tmp_path_factory.mktemp("families"), "qwen3", "llama31")


# ------------------------------------------------------------------------------- configs
def test_qwen3_config_read_and_written(hf_dirs):
    m = model_config_from_hf(hf_dirs / "qwen3")
    assert (m.architecture, m.qk_norm, m.qkv_bias, m.head_dim) == ("qwen3", True, False, 32)
    assert m.head_dim != m.hidden_size // m.num_attention_heads
    shapes = hf_shapes(m)
    assert shapes["model.layers.1.self_attn.k_norm.weight"] == (32,)
    assert set(shapes) == set(load_dir(hf_dirs / "qwen3"))  # exactly the checkpoint's tensors
    names = {s.local for s in param_specs(m, _parallel(), 0)}
    assert "decoder.layers.0.self_attention.q_layernorm.weight" in names
    assert layer_params(m) == layer_params(ModelConfig(**{**vars(m), "architecture": "llama"})) \
        + 2 * 32
    out = hf_dirs / "written_qwen3"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(hf_config_dict(m)))
    assert model_config_from_hf(out) == m


def test_llama31_rope_read_and_written(hf_dirs):
    from transformers import AutoConfig

    m = model_config_from_hf(hf_dirs / "llama31")
    assert (m.rope_type, m.rope_factor, m.rope_theta) == ("llama3", 8.0, 500000.0)
    out = hf_dirs / "written_llama31"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(hf_config_dict(m)))
    assert model_config_from_hf(out) == m
    assert AutoConfig.from_pretrained(out).rope_parameters == LLAMA3_ROPE


def _parallel():
    from megagrpo.config.model import ParallelConfig

    return ParallelConfig()


REFUSED = [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     r"rope_parameters\.rope_type='yarn' is not supported"),
    ({"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}},
     r"rope_scaling\.rope_type='linear' is not supported"),
    ({"rope_parameters": {**LLAMA3_ROPE, "low_freq_factor": 2.0}},
     r"rope_parameters\.low_freq_factor=2\.0 is not supported: megatron-core's llama3"),
    ({"rope_parameters": {**LLAMA3_ROPE, "original_max_position_embeddings": 4096}},
     r"original_max_position_embeddings=4096"),
    ({"use_sliding_window": True, "sliding_window": 64}, r"use_sliding_window=true is not"),
    ({"sliding_window": 4096}, r"sliding_window=4096 is not supported"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, r"layer_types holds"),
    ({"kv_lora_rank": 512}, r"kv_lora_rank=512 is not supported \(multi-head latent"),
    ({"num_nextn_predict_layers": 1}, r"num_nextn_predict_layers=1 is not supported \(multi"),
    ({"attention_sink_size": 4}, r"attention_sink_size=4 is not supported \(attention sinks"),
    ({"num_experts": 8}, r"num_experts=8 is not supported \(mixture of experts"),
    ({"model_type": "mistral"}, r"model_type='mistral' with architectures=\['LlamaForCausalLM'\]"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
]


@pytest.mark.parametrize("change,match", REFUSED)
def test_unsupported_features_refused_naming_the_key(hf_dirs, tmp_path, change, match):
    d = edited_copy(hf_dirs / "llama31", tmp_path / "bad", **change)
    with pytest.raises(ValueError, match=match):
        model_config_from_hf(d)


def test_model_section_refuses_what_megatron_does_not_implement():
    for overrides, match in [(["model.rope_type=yarn"], r"model\.rope_type='yarn'"),
                             (["model.rope_type=llama3", "model.rope_high_freq_factor=2.0"],
                              r"model\.rope_high_freq_factor=2\.0: megatron-core's llama3"),
                             (["model.architecture=qwen3", "model.qkv_bias=true"],
                              r"model\.qkv_bias=true: Qwen3 has no QKV bias")]:
        with pytest.raises(ValueError, match=match):
            load_config(DEMO, overrides).validate(world_size=2)


def test_verify_refuses_bad_configs_and_tensors_before_compute(hf_dirs, tmp_path):
    rope = edited_copy(hf_dirs / "llama31", tmp_path / "rope",
                   rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    lacking = edited_copy(hf_dirs / "qwen3", tmp_path / "lacking")
    from safetensors.torch import load_file, save_file

    f = next(lacking.glob("*.safetensors"))
    sd = load_file(f)
    del sd["model.layers.1.self_attn.q_norm.weight"]  # a Qwen3 checkpoint without its q_norm
    save_file(sd, f, metadata={"format": "pt"})
    cases = [(rope, "rope_parameters.rope_type='dynamic'"),
             (lacking, "model.layers.1.self_attn.q_norm.weight")]
    with ThreadPoolExecutor(max_workers=2) as pool:  # single-threaded processes: a core each
        done = list(pool.map(lambda case: run_cli("verify", "--hf", str(case[0]), "--tp", "2"),
                             cases))
    for (_, needle), p in zip(cases, done):
        assert p.returncode == 2 and needle in p.stderr, p.stderr[-2000:]
        assert "distributed:" not in p.stderr + p.stdout  # refused before any rank started


# ------------------------------------------------------------------------------- verify
@pytest.fixture(scope="module")
def verified(hf_dirs, qwen3_run, tmp_path_factory):
    """One 2-rank launch: verify at TP=1 (DP=2) for both families, again with a broken k/v
    mapping, Qwen3 at TP=2 on the trained export, Llama-3.1 at PP=2; prompts up to 512 tokens."""
    from tests.support.launch import run_ranks

    out = tmp_path_factory.mktemp("verify") / "codes.json"
    q, ll, export = hf_dirs / "qwen3", hf_dirs / "llama31", qwen3_run[0]
    jobs = [f"{q}:1:1", f"{q}:1:1:broken", f"{ll}:1:1", f"{ll}:1:1:broken", f"{export}:2:1",
            f"{ll}:1:2"]
    text = run_ranks(str(ROOT / "tests" / "_verify_worker.py"), 2, "--out", str(out),
                    "--seq-len", LONG, *jobs)
    return dict(zip(["qwen3", "qwen3_broken", "llama31", "llama31_broken", "export_tp2",
                     "llama31_pp2"], json.loads(out.read_text()))), text


def test_verify_passes_at_tp1_and_fails_on_a_broken_mapping(verified):
    codes, text = verified
    assert (codes["qwen3"], codes["llama31"]) == (0, 0), text[-6000:]
    assert (codes["qwen3_broken"], codes["llama31_broken"]) == (1, 1), text[-6000:]
    assert text.count("verify: FAILED") == 2 and text.count("tensors differ") == 2
    # 4 random prompts of 128-512 tokens; the export (5th job) adds its tokenizer's sentences
    assert text.count("4 prompts (1280 tokens)") == 5


def test_verify_at_a_split_round_trips_bitwise(verified):
    codes, text = verified
    assert (codes["export_tp2"], codes["llama31_pp2"]) == (0, 0), text[-6000:]
    assert "qwen3, 2 layers, tp=2 pp=1" in text and "bitwise equal (25 tensors)" in text
    assert "llama, llama3 RoPE, 2 layers, tp=1 pp=2" in text
    assert "bitwise equal (21 tensors)" in text and text.count("verify: ok") == 4


def test_llama3_scaling_changes_the_logits_where_verify_looks(hf_dirs, tmp_path):
    """verify (megatron vs transformers, both scaled) passes at 1e-5 over positions up to 512;
    here transformers on the same weights without the scaling is >= 1e-3 away there, so a
    megatron model that ignored the scaling could not pass."""
    from transformers import AutoModelForCausalLM

    plain = edited_copy(hf_dirs / "llama31", tmp_path / "plain",
                    rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    ids = torch.randint(0, 100, (1, int(LONG)), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        scaled, unscaled = (AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
                            .eval()(ids).logits[0] for d in (hf_dirs / "llama31", plain))
    rel = (scaled - unscaled).abs().amax(-1) / scaled.abs().max()
    assert rel[:8].max() < rel[256:].max() and rel[256:].max() > 1e-2  # grows with position


@pytest.mark.heavy  # ~30 s (a vLLM engine of its own); the default suite runs vLLM on Qwen3
def test_vllm_applies_llama3_scaling(hf_dirs, tmp_path):
    """vLLM from the config.json megagrpo writes for the engine (hf_config_dict), fed the HF
    weights by name: greedy tokens and log-probs after a 400-token prompt equal transformers'."""
    import vllm  # noqa: F401
    from transformers import AutoModelForCausalLM

    from megagrpo.config.rollout import RolloutConfig
    from megagrpo.engine import SamplingSettings, VLLMEngine
    from tests._rollout_model import hf_greedy

    model = AutoModelForCausalLM.from_pretrained(hf_dirs / "llama31", dtype=torch.float32).eval()
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(
        model_config_from_hf(hf_dirs / "llama31"))))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    engine = VLLMEngine(RolloutConfig(max_model_len=512, max_num_seqs=4, seed=0), tmp_path,
                        dtype="float32")
    try:
        engine.update_weights(iter(model.state_dict().items()))
        prompt = torch.randint(0, 100, (400,), generator=torch.Generator().manual_seed(1))
        comp = engine.generate([prompt.tolist()], SamplingSettings(temperature=0.0,
                                                                  max_tokens=8))[0]
    finally:
        engine.close()
    ref, ref_lp = hf_greedy(model, prompt.tolist(), 8)
    assert comp.token_ids == ref
    assert max(abs(a - b) for a, b in zip(comp.logprobs, ref_lp)) < 1e-4


# ------------------------------------------------------------------------------- GRPO
@pytest.fixture(scope="module")
def qwen3_run(hf_dirs):
    """2 GRPO steps (vLLM rollouts, reference reset every step) from the Qwen3 folder, one
    rank; the run directory exported to HF. A length term keeps a group's rewards apart, so a
    random model's steps have a gradient."""
    run, out = hf_dirs / "run", hf_dirs / "export"
    p = run_cli("train", "--config", DEMO, "--nproc", "1", f"run.init={hf_dirs / 'qwen3'}",
             "run.steps=2", f"run.out_dir={run}", "data.batch_size=4", "algo.group_size=4",
             "algo.num_minibatches=1", "reference.sync_every_steps=1", "checkpoint.at_end=true",
             "cold_start.steps=0", "eval.every=0", "log.tensorboard=false",
             "log.progress=false", "compute.micro_batch_size=16",
             "reward.terms=[{name: arithmetic}, {name: 'tests._rewards:length_reward', "
             "weight: 0.01}]")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    p = run_cli("convert", "--from-megatron", str(run), "--to-hf", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return out, metrics


def test_qwen3_grpo_with_vllm_and_export(qwen3_run, hf_dirs):
    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

    out, metrics = qwen3_run
    steps = [m for m in metrics if "logp_gap_vllm_mean" in m]
    assert len(steps) == 2
    # vLLM's Qwen3 (fed from megatron's shards) scores its samples as the trainer does
    assert all(m["logp_gap_vllm_mean"] < 1e-5 for m in steps)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(model, Qwen3ForCausalLM)
    src, got = load_dir(hf_dirs / "qwen3"), load_dir(out)
    assert sorted(src) == sorted(got)
    assert any(not torch.equal(src[k], got[k]) for k in src)  # training moved the weights
    eos = model.generation_config.eos_token_id
    assert eos is not None and eos == json.loads((out / "config.json").read_text())["eos_token_id"]


@pytest.mark.parametrize("recipe,arch,params_b", [("qwen3-8b-math.yaml", "qwen3", 8.19),
                                                   ("llama3.1-8b-math.yaml", "llama", 8.03),
                                                   ("qwen3-8b-32k-reasoning.yaml", "qwen3", 8.19)])
def test_recipes_validate_and_plan_without_weights(recipe, arch, params_b, capsys):
    from megagrpo.plan import run_plan, total_params

    cfg = load_config(str(ROOT / "examples" / recipe))
    cfg.validate(world_size=8)
    assert cfg.model.architecture == arch
    assert round(total_params(cfg.model) / 1e9, 2) == params_b  # the published sizes
    assert run_plan(str(ROOT / "examples" / recipe), [], gpus=8, gpu_mem_gib=80) == 0
    out = capsys.readouterr().out
    assert "fits: yes" in out and ("(llama3 RoPE x8)" in out) == (arch == "llama")


@pytest.mark.heavy
@pytest.mark.parametrize("family", ["qwen3", "llama31"])
def test_convert_round_trip_tp2_to_tp1_bitwise(hf_dirs, tmp_path, family):
    """Through dist-checkpointing: HF -> megatron at TP=2 -> HF at TP=1, every tensor equal."""
    src = hf_dirs / family
    p = run_cli("convert", "--from-hf", str(src), "--to-megatron", str(tmp_path / "m"), "--tp", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    p = run_cli("convert", "--from-megatron", str(tmp_path / "m"), "--to-hf", str(tmp_path / "out"))
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = load_dir(src), load_dir(tmp_path / "out")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert model_config_from_hf(tmp_path / "out") == model_config_from_hf(src)


@pytest.mark.heavy
def test_verify_cli_relaunches_and_runs_bf16(hf_dirs):
    """The command as a user runs it: one process relaunching itself under torchrun (PP=2),
    both models in bf16: within the bf16 tolerance, and visibly not float32."""
    import re

    p = run_cli("verify", "--hf", str(hf_dirs / "qwen3"), "--pp", "2", "--dtype", "bfloat16")
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    err = float(re.search(r"max relative error (\S+) \(tolerance 5e-02\)", p.stdout).group(1))
    assert 1e-4 < err < 5e-2 and "tp=1 pp=2, bfloat16" in p.stdout
