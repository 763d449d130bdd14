"""`python -m megagrpo convert` and bad-input handling: errors name the field and what is
valid, and stop before any process group or model is built."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from megagrpo.config.model import ModelConfig, ParallelConfig
from megagrpo.hf import check_hf_checkpoint, model_config_from_hf
from tests.support.cli import run_cli
from tests.support.tiny import load_dir, tiny_llama, tiny_qwen2


def test_convert_round_trip_tp2_pp2_to_tp1(tmp_path):
    tiny_qwen2(tmp_path / "hf", tie=True)
    p = run_cli("convert", "--from-hf", str(tmp_path / "hf"), "--to-megatron", str(tmp_path / "m"),
             "--tp", "2", "--pp", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    p = run_cli("convert", "--from-megatron", str(tmp_path / "m"), "--to-hf", str(tmp_path / "out"))
    assert p.returncode == 0, p.stderr[-3000:]
    src, out = load_dir(tmp_path / "hf"), load_dir(tmp_path / "out")
    src.pop("lm_head.weight", None)
    assert sorted(src) == sorted(out)
    for k in src:
        assert torch.equal(src[k], out[k]), k
    assert model_config_from_hf(tmp_path / "out") == model_config_from_hf(tmp_path / "hf")


@pytest.mark.parametrize("tp,field", [(3, "num_attention_heads"), (4, "num_query_groups")])
def test_tp_must_divide_heads_and_groups(tp, field):
    model = ModelConfig(num_attention_heads=4, num_query_groups=2, ffn_hidden_size=256)
    with pytest.raises(ValueError, match=rf"parallel.tp={tp} does not divide model.{field}"):
        ParallelConfig(tp=tp).validate(model)


def test_pp_must_divide_layers():
    msg = r"parallel.pp=3 .* model.num_layers=4; valid pp: \[1, 2, 4\]"
    with pytest.raises(ValueError, match=msg):
        ParallelConfig(pp=3).validate(ModelConfig(num_layers=4))


def test_world_size_must_be_multiple_of_tp_pp():
    with pytest.raises(ValueError, match="world size 6 is not divisible by .* 2 x 2"):
        ParallelConfig(tp=2, pp=2).validate(ModelConfig(num_layers=2), world_size=6)


def test_world_size_checked_before_process_group(tmp_path):
    code = ("from megagrpo.config.model import *; "
            "from megagrpo.runtime.distributed import init_distributed; "
            "init_distributed(ParallelConfig(tp=2), ModelConfig())")
    e = dict(os.environ, WORLD_SIZE="3", RANK="0", LOCAL_RANK="0")
    # were the check after init_process_group, this would hang waiting for 2 more ranks
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e,
                       timeout=60)
    assert p.returncode != 0 and "world size 3 is not divisible" in p.stderr


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"architectures=\['GPT2LMHeadModel'\] is not supported; "
                                         r"supported: \['LlamaForCausalLM', 'Qwen2ForCausalLM', "
                                         r"'Qwen2MoeForCausalLM', "
                                         r"'Qwen2_5_VLForConditionalGeneration', "
                                         r"'Qwen3ForCausalLM', 'Qwen3MoeForCausalLM'\]"):
        model_config_from_hf(tmp_path)


def _only_file(d):
    return next(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".safetensors"))


def test_missing_tensor_named_and_cli_stops_before_compute(tmp_path):
    tiny_llama(tmp_path / "hf")
    path = _only_file(tmp_path / "hf")
    sd = load_file(path)
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, path, metadata={"format": "pt"})
    model = model_config_from_hf(tmp_path / "hf")
    with pytest.raises(ValueError, match=r"lacks tensors \['model.layers.1.mlp.up_proj.weight'\]"):
        check_hf_checkpoint(tmp_path / "hf", model)
    p = run_cli("convert", "--from-hf", str(tmp_path / "hf"), "--to-megatron", str(tmp_path / "m"),
             "--tp", "2")
    assert p.returncode == 2 and "model.layers.1.mlp.up_proj.weight" in p.stderr
    assert "distributed:" not in p.stderr + p.stdout  # no process group was started
    assert not (tmp_path / "m").exists()


def test_misshaped_tensor_named(tmp_path):
    tiny_llama(tmp_path / "hf")
    path = _only_file(tmp_path / "hf")
    sd = load_file(path)
    sd["model.layers.0.self_attn.k_proj.weight"] = sd["model.layers.0.self_attn.k_proj.weight"][:32]
    save_file(sd, path, metadata={"format": "pt"})
    msg = r"k_proj.weight' has shape \[32, 64\], expected \[64, 64\]"
    with pytest.raises(ValueError, match=msg):
        check_hf_checkpoint(tmp_path / "hf", model_config_from_hf(tmp_path / "hf"))


def test_unsupported_feature_flags(tmp_path):
    tiny_llama(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["mlp_bias"] = True
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="mlp_bias=true is not supported"):
        model_config_from_hf(tmp_path / "hf")
