"""The planner's LoRA-vs-full lines (megagrpo/plan/lora.py): refit bytes per step against a hand
count from the Hugging Face tensor shapes, the merged fallback where vLLM cannot serve the
adapters, and the large LoRA recipe in examples/ planned without weights."""
from pathlib import Path

from megagrpo.config.train import load_config
from megagrpo.plan import rank_memory, run_plan
from megagrpo.plan.lora import format_lora_vs_full, refit_bytes

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# vocab 100, H 8, F 12, 2 layers, 4 query heads and 2 KV heads of width 3: q 12, k = v 6 wide
TINY = ["model.vocab_size=100", "model.hidden_size=8", "model.ffn_hidden_size=12",
        "model.num_layers=2", "model.num_attention_heads=4", "model.num_query_groups=2",
        "model.head_dim=3", "parallel.make_vocab_size_divisible_by=8", "model.dtype=bfloat16",
        "compute.micro_batch_size=2", "rollout.max_model_len=8", "data.batch_size=4",
        "lora.rank=2"]
# the HF checkpoint's tensors of that model, [out, in] as transformers stores them
HF_LAYER = {"q_proj": (12, 8), "k_proj": (6, 8), "v_proj": (6, 8), "o_proj": (8, 12),
            "gate_proj": (12, 8), "up_proj": (12, 8), "down_proj": (8, 12)}
HF_NORMS = 2 * 8  # input_layernorm, post_attention_layernorm


def _hf_numel() -> int:
    per_layer = sum(o * i for o, i in HF_LAYER.values()) + HF_NORMS
    return 100 * 8 + 2 * per_layer + 8 + 100 * 8  # embed_tokens, layers, norm, lm_head


def _peft_numel(r: int, modules: list[str]) -> int:
    """lora_A [r, in] and lora_B [out, r] per module per layer, as peft saves them."""
    return 2 * sum(r * (HF_LAYER[p][1] + HF_LAYER[p][0]) for p in modules)


def test_refit_bytes_by_hand_from_the_hf_shapes():
    cfg = load_config(None, TINY)
    refit = refit_bytes(cfg, cfg.model)
    # embeddings 800, per layer 96 + 48 + 48 + 96 + 3 * 96 + 16 norms, final norm, lm_head 800
    assert _hf_numel() == 800 + 2 * 592 + 8 + 800
    assert refit.model == 2 * _hf_numel()  # bf16
    # r (in + out) per module: q 2*20, k 2*14, v 2*14, o, gate, up, down 2*20 each; 2 layers
    assert refit.adapters == 2 * _peft_numel(2, list(HF_LAYER)) == 2 * 2 * 2 * 128
    assert refit.fallback == ""
    assert (refit.between_merges, refit.after_merge) == (refit.adapters,
                                                          refit.model + refit.adapters)
    attn = load_config(None, TINY + ["lora.targets=[qkv,proj]"])
    assert refit_bytes(attn, attn.model).adapters == 2 * _peft_numel(
        2, ["q_proj", "k_proj", "v_proj", "o_proj"])


def test_merged_fallback_refits_the_model_and_says_why():
    cfg = load_config(None, TINY + ["lora.rank=1024"])  # above vLLM's largest max_lora_rank
    refit = refit_bytes(cfg, cfg.model)
    assert "lora.rank=1024 exceeds vLLM's largest max_lora_rank" in refit.fallback
    assert refit.between_merges == refit.after_merge == refit.model == 2 * _hf_numel()
    text = format_lora_vs_full(cfg, cfg.model, rank_memory(cfg, cfg.model, 1, 1, 1, 1.0), 1, 1.0)
    assert "refit path: the merged model every step" in text
    assert "lora.rank=1024 exceeds" in text and "(not the path that runs)" in text
    # engines of TP 2 serve the adapters (tests/test_separate_tp.py measures it)
    tp2 = load_config(None, TINY + ["rollout.tensor_parallel_size=2", "parallel.tp=2"])
    assert refit_bytes(tp2, tp2.model).fallback == ""


def test_lora_vs_full_rows():
    """Trainable parameters, optimizer state and reference copy of the two columns: the full
    column is the recipe with lora.rank=0, the LoRA column the adapters (megatron's fused
    layout: one A per fused layer) with no reference."""
    cfg = load_config(None, TINY + ["model.dtype=float32"])
    lora = rank_memory(cfg, cfg.model, 1, 1, 1, 1.0)
    text = format_lora_vs_full(cfg, cfg.model, lora, 1, 1.0)
    rows = {ln[:42].strip(): ln[42:].split() for ln in text.splitlines()[2:10]}
    # qkv A [2, 8] + B [24, 2], proj A [2, 12] + B [8, 2], fc1 A [2, 8] + B [24, 2],
    # fc2 A [2, 12] + B [8, 2]; two layers
    fused = 2 * 2 * (8 + 24 + 12 + 8 + 8 + 24 + 12 + 8)
    assert rows["trainable parameters (whole model)"][:2] == [
        f"{_hf_numel() / 1e6:.1f}M", f"{fused / 1e6:.1f}M"]
    assert rows["Adam state per rank"][2:4] == [f"{8 * fused / 1024:.3f}", "KiB"]
    assert rows["reference copy per rank (resident)"][2:4] == ["0", "B"]
    full_ref = rows["reference copy per rank (resident)"][:2]
    assert full_ref != ["0", "B"]  # algo.beta > 0: full fine-tuning keeps a copy
    assert rows["refit per step, between merges"][2:4] == ["2.000", "KiB"]  # 4 * 512


def test_large_lora_recipe_plans_without_weights(capsys):
    """examples/qwen3-32b-lora-math.yaml validates on one 8-GPU node and plans from its model
    section: the adapter-only refit is 256 MiB, counted by hand from Qwen3-32B's HF shapes, and
    at most 2% of the model's bytes; the layout is the one the planner suggests."""
    path = str(EXAMPLES / "qwen3-32b-lora-math.yaml")
    cfg = load_config(path)
    cfg.validate(world_size=8)
    assert run_plan(path, [], gpus=8, gpu_mem_gib=139) == 0
    out = capsys.readouterr().out
    # r (in + out) per layer: q 5120+8192, k and v 5120+1024, o 8192+5120, gate and up
    # 5120+25600, down 25600+5120; rank 16, 64 layers, bf16
    per_layer = (5120 + 8192) + 2 * (5120 + 1024) + (8192 + 5120) + 2 * (5120 + 25600) + 30720
    adapters = 16 * per_layer * 64 * 2
    assert adapters == 256 * 2**20
    refit = refit_bytes(cfg, cfg.model)
    assert refit.adapters == adapters and refit.fallback == ""
    assert refit.adapters <= 0.02 * refit.model  # the target, met at this width
    assert "refit per step, between merges" in out and "256.000 MiB" in out
    assert "refit path: the adapters (vLLM serves them)" in out
    assert (f"suggested: parallel.tp={cfg.parallel.tp} parallel.pp={cfg.parallel.pp} "
            f"(dp={8 // (cfg.parallel.tp * cfg.parallel.pp)})") in out


def test_refit_bytes_of_an_moe_count_every_expert():
    """An MoE model's adapters in peft's layout, counted by hand: per layer q/k/v/o and, for
    each of 4 routed experts and the shared expert, gate/up/down (a count that took every
    layer as one dense MLP of ffn_hidden_size gave 512 elements here, not 1160). And the
    rank's share: routed experts over EP, the shared expert whole."""
    from megagrpo.config.lora import LoRAConfig

    moe = ["model.architecture=qwen2_moe", "model.num_experts=4", "model.moe_topk=2",
           "model.moe_ffn_hidden_size=6", "model.shared_expert_ffn_hidden_size=10",
           "model.dtype=float32"]
    cfg = load_config(None, TINY + moe)
    r = 2
    attn = r * ((8 + 12) + (8 + 6) * 2 + (12 + 8))  # q, k, v, o as (in + out)
    expert = r * ((8 + 6) * 2 + (6 + 8))  # gate, up, down of width 6
    shared = r * ((8 + 10) * 2 + (10 + 8))
    assert refit_bytes(cfg, cfg.model).adapters == 4 * 2 * (attn + 4 * expert + shared) == 4 * 1160
    lcfg = LoRAConfig(rank=r)
    # one rank at ep=2, tp=1: 2 of the 4 experts, A [r, in] + B [out, r] per fused weight
    fused = r * (8 + 24) + r * (12 + 8) + 2 * (r * (8 + 12) + r * (6 + 8)) \
        + r * (8 + 20) + r * (10 + 8)
    assert lcfg.rank_numel(cfg.model, 1, 2, ep=2) == 2 * fused
