"""The one parameter layout (`megagrpo.config.params`) against independent references, for every
family: the tensors a transformers checkpoint holds, the state dict of a transformers model
built from the same config (what the vLLM feed used to be checked against), and the parameters
of the megatron-core model each rank actually builds at TP / PP / EP layouts (2 real ranks).
The planner's counts are derived from the same specs, so they are checked against the same
references."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from megagrpo.config.model import ModelConfig, ParallelConfig
from megagrpo.hf import hf_shapes, model_config_from_hf, param_specs
from megagrpo.plan import expert_params, layer_params, stage_params, total_params
from tests.support.tiny import tiny_llama, tiny_qwen2, tiny_qwen2_moe, tiny_qwen3, tiny_qwen3_moe

BUILDERS = {"llama": tiny_llama, "qwen2": tiny_qwen2, "qwen3": tiny_qwen3,
            "qwen3_moe": tiny_qwen3_moe, "qwen2_moe": tiny_qwen2_moe}
BASE = dict(vocab_size=100, hidden_size=64, ffn_hidden_size=128, num_layers=2,
            num_attention_heads=4, num_query_groups=2, head_dim=32)
# tiny configs of each family (dimensions as tests/hf_tiny.py), tied and dense layers included
MODELS = {
    "llama": dict(architecture="llama", tie_word_embeddings=True),
    "qwen2": dict(architecture="qwen2", qkv_bias=True),
    "qwen3": dict(architecture="qwen3"),
    "qwen3_moe": dict(architecture="qwen3_moe", num_experts=4, moe_topk=2,
                      moe_ffn_hidden_size=64, moe_norm_topk_prob=True),
    "qwen2_moe": dict(architecture="qwen2_moe", qkv_bias=True, num_experts=4, moe_topk=2,
                      moe_ffn_hidden_size=64, shared_expert_ffn_hidden_size=48,
                      moe_dense_layers=[1]),
}
# (tp, pp, ep) on 2 ranks: DP = 2 / (tp * pp), EP inside DP
LAYOUTS = {"llama": [(2, 1, 1), (1, 2, 1)], "qwen2": [(2, 1, 1), (1, 2, 1)],
           "qwen3": [(2, 1, 1), (1, 2, 1)], "qwen3_moe": [(2, 1, 1), (1, 2, 1), (1, 1, 2)],
           "qwen2_moe": [(2, 1, 1), (1, 2, 1), (1, 1, 2)]}


def _model(family: str) -> ModelConfig:
    m = ModelConfig(**{**BASE, **MODELS[family]})
    m.validate()
    return m


def _parallel(tp: int, pp: int, ep: int) -> ParallelConfig:
    return ParallelConfig(tp=tp, pp=pp, ep=ep, make_vocab_size_divisible_by=8)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("param_specs")
    models = {name: build(root / name) for name, build in BUILDERS.items()}
    return root, models


def _checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in an HF safetensors directory (headers only)."""
    from safetensors import safe_open

    out = {}
    for f in path.glob("*.safetensors"):
        with safe_open(f, "pt") as h:
            out.update({k: tuple(h.get_slice(k).get_shape()) for k in h.keys()})
    return out


def _state_dict_shapes(hf_config) -> dict[str, tuple[int, ...]]:
    """The checkpoint names and shapes of a transformers model built from `hf_config` on the
    meta device; transformers 5 holds an MoE layer's experts as 3D tensors (gate_up_proj
    [E, 2I, H], down_proj [E, H, I]) but checkpoints and vLLM name them per expert."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base, (E, two_i, H) = name[: -len("gate_up_proj")], tuple(t.shape)
            for e in range(E):
                out[f"{base}{e}.gate_proj.weight"] = out[f"{base}{e}.up_proj.weight"] = (
                    two_i // 2, H)
        elif name.endswith("mlp.experts.down_proj"):
            base, (E, H, inter) = name[: -len("down_proj")], tuple(t.shape)
            for e in range(E):
                out[f"{base}{e}.down_proj.weight"] = (H, inter)
        else:
            out[name] = tuple(t.shape)
    return out


@pytest.mark.parametrize("family", list(BUILDERS))
def test_hf_shapes_are_the_checkpoint_transformers_writes(hf_dirs, family):
    root, models = hf_dirs
    m = model_config_from_hf(root / family)
    shapes = hf_shapes(m)
    assert shapes == _checkpoint_shapes(root / family)
    # the planner's count is the one transformers reports (a tied embedding counted once)
    assert total_params(m) == sum(p.numel() for p in models[family].parameters())
    assert total_params(m) == sum(math.prod(s) for s in shapes.values())


@pytest.mark.parametrize("family", list(BUILDERS))
def test_vllm_feed_expects_the_transformers_state_dict(hf_dirs, family):
    from transformers import AutoConfig

    from megagrpo.engine import expected_hf_params

    root, _ = hf_dirs
    cfg = AutoConfig.from_pretrained(root / family)
    shapes, optional = expected_hf_params(cfg)
    assert {n: tuple(s) for n, s in shapes.items()} == _state_dict_shapes(cfg)
    assert optional == ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    tied = type(cfg)(**{**cfg.to_dict(), "tie_word_embeddings": True})
    shapes, optional = expected_hf_params(tied)
    assert {n: tuple(s) for n, s in shapes.items()} == _state_dict_shapes(tied)
    assert optional == {"lm_head.weight"}


@pytest.mark.parametrize("family", list(MODELS))
def test_planner_counts_are_the_specs_local_sizes(family):
    """Per rank of every stage and EP rank: the planner's count = the sum of the specs' local
    shapes; the routed experts' share = those of the specs an EP rank owns."""
    m = _model(family)
    for tp, pp, ep in [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2), (2, 1, 2)]:
        p = _parallel(tp, pp, ep)
        for stage in range(pp):
            for ep_rank in range(ep):
                specs = param_specs(m, p, stage, ep_rank=ep_rank)
                local = sum(math.prod(s.local_shape(tp)) for s in specs)
                assert stage_params(m, p, stage) == local, (tp, pp, ep, stage, ep_rank)
                routed = sum(math.prod(s.local_shape(tp)) for s in specs if s.ep_owner == ep_rank)
                layers = range(stage * m.num_layers // pp, (stage + 1) * m.num_layers // pp)
                assert (expert_params(m, tp, ep, layers) if m.is_moe else 0) == routed
    if m.is_moe:  # one token runs through k of the E experts of an MoE layer
        full = layer_params(m, layer=0)
        one = 3 * m.moe_ffn_hidden_size * m.hidden_size
        assert layer_params(m, layer=0, active=True) == full - (m.num_experts - m.moe_topk) * one


def shared_job(work: Path) -> tuple[list[str], list[str]]:
    """This module's part of the shared 2-rank launch (tests/conftest.py): this file as the
    worker, every family at its layouts."""
    jobs = [f"{family}:{tp}:{pp}:{ep}" for family, layouts in LAYOUTS.items()
            for tp, pp, ep in layouts]
    return [__file__, "--out", str(work), *jobs], jobs


def test_specs_are_the_megatron_parameters_at_each_layout(shared_launch):
    """Each of 2 real ranks builds every family at tp=2, pp=2 and (MoE) ep=2: its parameters'
    names and shapes are the specs of its stage and EP rank, their count the planner's."""
    work, jobs = shared_launch[__name__]
    for rank in range(2):
        records = json.loads((work / f"rank{rank}.json").read_text())
        assert [r["job"] for r in records] == jobs
        for r in records:
            family, tp, pp, ep = r["job"].split(":")
            m, p = _model(family), _parallel(int(tp), int(pp), int(ep))
            specs = param_specs(m, p, r["pp_rank"], ep_rank=r["ep_rank"])
            want = {s.local: list(s.local_shape(p.tp)) for s in specs}
            assert r["params"] == want, r["job"]
            assert sum(math.prod(s) for s in r["params"].values()) == \
                stage_params(m, p, r["pp_rank"]), r["job"]


def _worker(out: Path, jobs: list[str]) -> None:
    """Builds each job's model on this rank and records its parameters' names and shapes."""
    import torch.distributed as dist

    from megagrpo.hf import expert_parallel_rank
    from megagrpo.model.gpt import build_model, unwrap
    from megagrpo.runtime.distributed import init_distributed, shutdown

    records = []
    for job in jobs:
        family, tp, pp, ep = job.split(":")
        m, p = _model(family), _parallel(int(tp), int(pp), int(ep))
        info = init_distributed(p, m)
        gpt = unwrap(build_model(m, p))
        records.append({"job": job, "pp_rank": info.pp_rank, "ep_rank": expert_parallel_rank(p),
                        "params": {n: list(t.shape) for n, t in gpt.named_parameters()}})
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(records))
    shutdown()


if __name__ == "__main__":  # the worker of the multi-rank test, one per rank (run_ranks)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    _worker(Path(sys.argv[2]), sys.argv[3:])
