"""LoRA on megatron-core (megagrpo.lora.layers): the adapters' reduced gradients at TP=2, PP=2 and
DP=2 equal a float64 plain-torch LoRA on transformers' model; the base gets no gradient and the
optimizer (plain and distributed) holds the adapters only; a merge (the reference reset) leaves
the policy's logits unchanged within fp32 rounding, makes the reference's logits equal them
bitwise (KL 0), and mixing with alpha moves the reference to alpha * policy + (1 - alpha) *
reference in weight space; checkpoints hold the frozen base only after a merge (the adapters and
their Adam moments otherwise, counted by hand) and load at another layout. The shared
2-rank launch (tests/conftest.py): tests/_lora_worker.py."""
import copy
import json
import os

import pytest
import torch
import torch.nn.functional as F

from megagrpo.config.lora import LoRAConfig
from megagrpo.config.model import ModelConfig, ParallelConfig
from megagrpo.config.train import TrainConfig
from tests.support.cli import run_cli
from tests.support.tiny import load_dir, tiny_llama, tiny_qwen2_moe

WORKER = os.path.join(os.path.dirname(__file__), "_lora_worker.py")
TAGS = ("tp2", "tp2_sp", "pp2", "dp2")
"""Layouts whose gradients are checked; "dp2_distopt" (the distributed optimizer) is checked for
what its optimizer holds."""
SCALE = 8.0 / 4  # the worker's lora alpha / rank
FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "fc1",
         "up_proj": "fc1", "o_proj": "proj", "down_proj": "fc2"}


def shared_job(work):
    """This module's part of the shared 2-rank launch (tests/conftest.py): the tiny Llama and
    MoE models and their batches under `work`."""
    llama = tiny_llama(work / "llama")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (2, 10), generator=g)
    labels = torch.randint(0, 100, (2, 10), generator=g)
    torch.save({"ids": ids, "labels": labels}, work / "ref.pt")
    tiny_qwen2_moe(work / "qwen2_moe")  # the MoE checks (tests/_lora_moe_worker.py)
    moe_ids = torch.randint(0, 100, (2, 12), generator=g)
    torch.save({"ids": moe_ids, "labels": torch.roll(moe_ids, -1, dims=1)}, work / "ref_moe.pt")
    return [WORKER, "--work", str(work)], (llama, ids, labels)


@pytest.fixture(scope="module")
def run(shared_launch):
    work, (llama, ids, labels) = shared_launch[__name__]
    return work, json.loads((work / "results.json").read_text()), llama, ids, labels


def _adapters(work, tag):
    """The union over ranks of the worker's {HF projection: {A, B}} values and grads."""
    values, grads = {}, {}
    for r in range(2):
        d = torch.load(work / f"{tag}_rank{r}.pt")
        values.update(d["values"])
        grads.update(d["grads"])
    return values, grads


def reference_grads(model, values, ids, labels):
    """Float64 transformers model + hand-written LoRA hooks (one A per fused megatron layer,
    shared by its HF parts; one B per part): the token-mean cross-entropy's gradients."""
    model = copy.deepcopy(model).double()
    for p in model.parameters():
        p.requires_grad_(False)
    a_leaf, leaves, hooks = {}, {}, []
    for name, v in values.items():
        layer, part = name.rsplit(".", 2)[0], name.rsplit(".", 1)[1]
        key = (layer, FUSED[part])
        if key not in a_leaf:
            a_leaf[key] = v["A"].clone().requires_grad_()
        b = v["B"].clone().requires_grad_()
        leaves[name] = (a_leaf[key], b)

        def hook(mod, inp, out, a=a_leaf[key], b=b):
            return out + SCALE * F.linear(F.linear(inp[0], a), b)

        hooks.append(model.get_submodule(name).register_forward_hook(hook))
    logits = model(ids).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    loss.backward()
    for h in hooks:
        h.remove()
    return {n: {"A": a.grad, "B": b.grad} for n, (a, b) in leaves.items()}


@pytest.mark.parametrize("tag", TAGS)
def test_adapter_grads_equal_float64_reference(run, tag):
    work, _, llama, ids, labels = run
    values, grads = _adapters(work, tag)
    assert len(values) == 2 * 7  # two layers x (q, k, v, o, gate, up, down)
    ref = reference_grads(llama, values, ids, labels)
    for name, g in grads.items():
        for which in ("A", "B"):
            want = ref[name][which]
            err = ((g[which] - want).abs().max() / want.abs().max()).item()
            assert err < 1e-5, (tag, name, which, err)


@pytest.mark.parametrize("tag", TAGS + ("dp2_distopt",))
def test_base_frozen_and_optimizer_holds_adapters(run, tag):
    rows = [r for r in run[1] if r.get("tag") == tag]
    assert len(rows) == 2 and all(r["step_ok"] for r in rows)
    assert all(r["base_with_grad"] == [] for r in rows)
    if tag == "dp2_distopt":  # each DP rank holds a shard of the adapters
        assert sum(r["opt_numel"] for r in rows) == rows[0]["adapter_numel"]
    else:
        assert all(r["opt_numel"] == r["adapter_numel"] for r in rows)
    for r in rows:  # Adam's two moments per adapter element held by this rank, in fp32
        assert r["opt_state_bytes"] == 2 * 4 * r["opt_numel"]
    # a merge's moment scaling (megagrpo.model.optim.scale_adam_moments) reaches A's moments as
    # megatron holds them (each distributed-optimizer rank: the A shards it owns), not B's
    assert all(r["moments_ok"] and r["moments_scaled"] == r["moments_found"] for r in rows)
    assert all(r["moments_found"] > 0 for r in rows)


@pytest.mark.parametrize("check", ["merge", "merge_sp", "merge_moe"])
def test_merge_reset_is_exact(run, check):
    """merge_sp: at TP=2 with sequence parallelism; merge_moe: at EP=2 on Qwen2-MoE, experts,
    shared expert and dense MLP adapted."""
    (res,) = [r for r in run[1] if r.get("check") == check][:1]
    assert not res["equals_before"] and res["equals_after"]
    assert res["policy_change"] <= 1e-5 * res["policy_scale"]
    assert res["ref_equals_policy"] and res["kl_max"] == 0.0
    assert res["mix_ref_rel_err"] < 1e-6
    assert res["mix_identity_rel_err"] < 1e-6
    assert res["mix_policy_rel_err"] < 1e-6


# ---------------------------------------------------------------------- bad input
def _cfg(**lora) -> TrainConfig:
    cfg = TrainConfig()
    cfg.lora = LoRAConfig(**{"rank": 8, **lora})
    return cfg


@pytest.mark.parametrize("change, field", [
    (dict(rank=-1), "lora.rank"),
    (dict(targets=["qkv", "attn"]), "lora.targets"),
    (dict(targets=[]), "lora.targets"),
    (dict(alpha=0.0), "lora.alpha"),
    (dict(dropout=1.0), "lora.dropout"),
    (dict(rank=100_000), "lora.rank"),
])
def test_bad_lora_settings_name_the_field(change, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        _cfg(**change).validate()


def test_lora_refuses_reference_offload_tp_dropout_and_expert_tp():
    cfg = _cfg()
    cfg.reference.offload = True
    with pytest.raises(ValueError, match=r"reference\.offload"):
        cfg.validate()
    cfg = _cfg(dropout=0.1)
    cfg.parallel = ParallelConfig(tp=2)
    with pytest.raises(ValueError, match=r"lora\.dropout"):
        cfg.validate()
    moe = ModelConfig(architecture="qwen3_moe", num_experts=4, moe_ffn_hidden_size=64)
    # experts are adapted at expert TP = 1 (any EP); expert TP > 1 is not built
    with pytest.raises(ValueError, match=r"lora\.targets holds \['fc1', 'fc2'\].*parallel\.tp=2"):
        LoRAConfig(rank=4).validate(moe, ParallelConfig(tp=2))
    LoRAConfig(rank=4).validate(moe, ParallelConfig())
    LoRAConfig(rank=4, targets=["qkv", "proj"]).validate(moe, ParallelConfig(tp=2))


def test_expert_adapters_are_refit_merged():
    """vLLM does not serve adapters on MoE experts (no CPU fused-MoE LoRA kernels): the run
    refits the merged weights and its console line says why; attention-only adapters on an MoE
    model, and a dense model's fc1/fc2, are served."""
    from megagrpo.lora.layers import describe
    from megagrpo.sync.adapters import unavailable

    moe = ModelConfig(architecture="qwen3_moe", num_experts=4, moe_ffn_hidden_size=64)
    why = unavailable(LoRAConfig(rank=4), 1, moe)
    assert "['fc1', 'fc2'] adapt MoE experts" in why
    assert "merged weights" in describe(10, 100, LoRAConfig(rank=4), why)
    assert unavailable(LoRAConfig(rank=4, targets=["qkv", "proj"]), 1, moe) == ""
    assert unavailable(LoRAConfig(rank=4), 1, ModelConfig()) == ""


def test_lora_refit_choice():
    """lora.refit: auto serves the adapters except on vLLM's CPU build (its LoRA decode is
    slower than the merged model's) or where vLLM cannot; merged never serves them; adapter
    refuses, naming the field, what cannot be served; a bad value is refused."""
    from megagrpo.sync.adapters import unavailable

    moe = ModelConfig(architecture="qwen3_moe", num_experts=4, moe_ffn_hidden_size=64)
    auto, adapter = LoRAConfig(rank=4), LoRAConfig(rank=4, refit="adapter")
    assert unavailable(auto, 1, ModelConfig(), on_cpu=False) == ""
    assert "CPU build" in unavailable(auto, 1, ModelConfig(), on_cpu=True)
    assert unavailable(adapter, 1, ModelConfig(), on_cpu=True) == ""
    assert unavailable(LoRAConfig(rank=4, refit="merged"), 1, ModelConfig()) == "lora.refit=merged"
    assert "MoE experts" in unavailable(auto, 1, moe, on_cpu=True)  # the first reason that holds
    # attention-only adapters on an MoE model: served on GPU; vLLM's CPU build cannot (its
    # experts switch to Triton kernels once LoRA is on), refused for lora.refit=adapter
    attention = LoRAConfig(rank=4, targets=["qkv", "proj"], refit="adapter")
    assert unavailable(attention, 1, moe, on_cpu=False) == ""
    with pytest.raises(ValueError, match=r"lora.refit=adapter, but an MoE model on vLLM's CPU"):
        unavailable(attention, 1, moe, on_cpu=True)
    # separate placement answers as colocated (its rollout ranks take adapter-only syncs)
    from megagrpo.train.tuning import build_tuning

    assert build_tuning(adapter).engine_lora_rank(1, ModelConfig()) == 8  # vLLM's next size
    assert unavailable(adapter, 2, ModelConfig()) == ""  # engines of TP 2 serve them too
    with pytest.raises(ValueError, match="lora.refit='fast'"):
        LoRAConfig(rank=4, refit="fast").validate(ModelConfig(), ParallelConfig())


def test_lora_off_by_default_and_scale():
    cfg = TrainConfig()
    assert not cfg.lora.enabled
    cfg.validate()
    assert LoRAConfig(rank=8, alpha=16).scale == 2.0


def test_adapters_reshard_through_a_checkpoint(run):
    """Saved at TP=2 (after the merge checks), loaded at PP=2: every adapter's full A and B."""
    work = run[0]
    saved, loaded = {}, {}
    for r in range(2):
        saved.update(torch.load(work / f"saved_rank{r}.pt"))
        loaded.update(torch.load(work / f"pp2_loaded_rank{r}.pt"))
    assert saved.keys() == loaded.keys() and len(saved) == 14
    for name in saved:
        for which in ("A", "B"):
            assert torch.equal(saved[name][which], loaded[name][which]), (name, which)


def _hand_bytes(work, r: int = 4) -> tuple[int, int]:
    """fp32 bytes of (megagrpo's adapters, the base) of the worker's Llama at TP=2, counted from
    its HF config: one A per fused layer (A [r, in], B [out, r] of qkv, proj, fc1 = gate|up,
    fc2); the base with megatron's vocabulary padded to a multiple of 64 * TP (untied)."""
    hf = json.loads((work / "llama" / "config.json").read_text())
    H, F, L = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"]
    hd = hf.get("head_dim") or H // hf["num_attention_heads"]
    q, kv = hf["num_attention_heads"] * hd, hf["num_key_value_heads"] * hd
    per = r * (H + q + 2 * kv) + r * (q + H) + r * (H + 2 * F) + r * (F + H)
    vocab = -(-hf["vocab_size"] // 128) * 128
    layer = 2 * H + (q + 2 * kv) * H + H * q + 2 * F * H + H * F
    return 4 * L * per, 4 * (2 * vocab * H + L * layer + H)


def test_checkpoints_hold_the_base_only_after_a_merge(run):
    """CheckpointManager over a LoRA policy's parts (keep_last=2): checkpoint 1 writes the base
    (base_000000), a merge, 2 writes base_000001, 3 (no merge since 2) writes none and names 2's;
    saving 3 removes 1 and base_000000, which nothing kept names. Checkpoint 3's tensors are the
    adapters and their two Adam moments, counted by hand; the merge's checkpoint costs the base
    on top."""
    work, results = run[0], run[1]
    r = next(x for x in results if x.get("check") == "checkpoints")
    assert r["after"] == {"1": ["base_000000", "step_000001"],
                          "2": ["base_000000", "base_000001", "step_000001", "step_000002"],
                          "3": ["base_000001", "step_000002", "step_000003"]}
    adapters, base = _hand_bytes(work)
    pay, size = r["payload"], r["bytes"]
    for step in ("step_000002", "step_000003"):  # the tensors each holds, by its metadata
        assert pay[f"{step}/policy"] == adapters and pay[f"{step}/optimizer"] == 2 * adapters
    assert pay["base_000001"] == base
    assert not any(f.startswith("base") for f in r["files_3"]), r["files_3"]
    without, with_merge = size["step_000003"], size["step_000002"] + size["base_000001"]
    print(f"\nLoRA rank 4 checkpoint on disk: {without:,} bytes without a merge since the last "
          f"one (adapters + Adam moments by hand: {3 * adapters:,}), {with_merge:,} with one "
          f"(+ the base, by hand {base:,})")
    # the rest is small: DCP frames each of the 48 tensors (16 adapters, 32 moments) with
    # torch.save (< 4 KiB), and metadata / JSON files (< 64 KiB)
    assert 3 * adapters <= without <= 3 * adapters + 48 * 4096 + 65536
    assert with_merge - without >= base


def test_checkpoint_without_its_base_loads_at_another_layout(run):
    """At PP=2 a manager over the LoRA parts loads checkpoint 3 (saved at TP=2; its base is
    2's): it knows the base is written (checkpoint 4 from there writes none, and keeps
    base_000001, which the pruned checkpoint 2 wrote) and the merge count is restored (the
    adapters' values: test_adapters_reshard_through_a_checkpoint). A checkpoint of the older
    one-folder format (base and adapters in policy/) loads too, and the next save writes its
    base into a folder of its own."""
    work, results = run[0], run[1]
    r = next(x for x in results if x.get("check") == "loaded")
    assert r["run_tp2"] == {"step": "step_000003", "written": "base_000001", "merges": 1,
                            "after_save": ["base_000001", "step_000003", "step_000004"]}
    assert r["old_tp2"] == {"step": "step_000003", "written": None, "merges": 1,
                            "after_save": ["base_000001", "step_000003", "step_000004"]}
    saved, old = {}, {}
    for rank in range(2):
        saved.update(torch.load(work / f"saved_rank{rank}.pt"))
        old.update(torch.load(work / f"old_pp2_rank{rank}.pt"))
    assert saved.keys() == old.keys() and saved
    assert all(torch.equal(saved[n][w], old[n][w]) for n in saved for w in ("A", "B"))


def test_convert_merges_a_lora_checkpoint(run, tmp_path):
    """`convert --from-megatron` of a checkpoint with adapters (TP=2, B not zero; its base
    written by the checkpoint before) at TP=1 writes the merged weights: those of the live
    model's merged export, and not the base's."""
    work = run[0]
    p = run_cli("convert", "--from-megatron", str(work / "run_tp2" / "checkpoints" /
                                                  "step_000003"), "--to-hf",
                str(tmp_path / "hf"))
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert "lora: the checkpoint's adapters (rank 4 on qkv,proj,fc1,fc2) are merged" in p.stdout
    got, want = load_dir(tmp_path / "hf"), load_dir(work / "export_tp2")
    assert got.keys() == want.keys()
    for k in want:
        assert torch.allclose(got[k], want[k], rtol=0, atol=1e-6), k
    saved = {}
    for r in range(2):
        saved.update(torch.load(work / f"saved_rank{r}.pt"))
    b = saved["model.layers.0.self_attn.q_proj"]["B"]
    assert b.abs().max() > 0  # the adapters were live: a base-only export would differ


def test_preflight_refuses_a_lora_checkpoint_as_init(tmp_path):
    from megagrpo.checkpoint import MODEL_JSON
    from megagrpo.preflight import check_init

    (tmp_path / MODEL_JSON).write_text(json.dumps({"model": {}, "lora": {"rank": 4}}))
    with pytest.raises(ValueError, match=r"run\.init=.*LoRA run's checkpoint"):
        check_init(str(tmp_path))


def test_planner_counts_adapters_only():
    """`megagrpo plan` with LoRA: grads and Adam state of the adapters only, no reference; the
    adapter count equals the model's (`add_adapters` on the midsize shape, counted by hand)."""
    from megagrpo.plan import rank_memory

    cfg = TrainConfig()
    m = ModelConfig(hidden_size=512, ffn_hidden_size=1536, num_layers=4, num_attention_heads=8,
                    num_query_groups=4, head_dim=64)
    full = rank_memory(cfg, m, 2, 1, 2, 80.0)
    cfg.lora = LoRAConfig(rank=16)
    lora = rank_memory(cfg, m, 2, 1, 2, 80.0)
    # per layer at TP=2: qkv A 16x512 + B 512x16, proj A 16x256 + B 512x16, fc1 A 16x512 +
    # B 1536x16, fc2 A 16x768 + B 512x16
    adapters = 4 * 16 * (512 + 512 + 256 + 512 + 512 + 1536 + 768 + 512)
    assert lora.optimizer == 8 * adapters and lora.grads == 4 * adapters
    assert lora.reference == 0 < full.reference
    assert lora.weights == full.weights + 4 * adapters


# ---------------------------------------------------------------------- peft export
def _hf_logits(folder, ids, adapter=None) -> torch.Tensor:
    """[B, S, V] fp32 logits of transformers' model of an HF folder, with peft's adapter from
    the folder `adapter` loaded onto it when given."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    with torch.no_grad():
        return model.eval()(ids).logits


def test_peft_export_at_tp2_gives_the_merged_logits(run):
    """The worker's export at TP=2 (after a merge reset and an alpha mix: the base is a merged
    base, B is not zero): peft's adapter on the exported base gives the merged export's logits;
    A is repeated per q/k/v (gate/up) and B's rows are each projection's; the same checkpoint
    loaded and exported at PP=2 gives the same two folders."""
    work, _, _, ids, _ = run
    cfg = json.loads((work / "peft_tp2" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8.0 and cfg["peft_type"] == "LORA"
    assert sorted(cfg["target_modules"]) == sorted(FUSED)
    want = _hf_logits(work / "export_tp2", ids)
    got = _hf_logits(work / "base_tp2", ids, adapter=work / "peft_tp2")
    base = _hf_logits(work / "base_tp2", ids)
    assert (got - want).abs().max().item() <= 1e-5
    assert (base - want).abs().max().item() > 1e-3  # the adapters change the logits
    saved = {}
    for r in range(2):
        saved.update(torch.load(work / f"saved_rank{r}.pt"))
    tensors = load_dir(work / "peft_tp2")
    assert len(tensors) == 2 * len(saved) == 28
    for mine, theirs in (("base_pp2", "base_tp2"), ("peft_pp2", "peft_tp2")):
        other = load_dir(work / mine)  # loaded at PP=2: stages gathered on rank 0
        assert other.keys() == load_dir(work / theirs).keys()
        assert all(torch.equal(other[k], t) for k, t in load_dir(work / theirs).items()), mine
    for name, v in saved.items():
        for which in ("A", "B"):
            t = tensors[f"base_model.model.{name}.lora_{which}.weight"]
            assert torch.equal(t.double(), v[which]), (name, which)


def test_convert_peft_adapter_of_a_tp2_checkpoint(run, tmp_path):
    """`convert --from-megatron RUN --to-hf BASE --peft-adapter DIR` at TP=1 of the run's
    newest checkpoint (its base in a folder an earlier checkpoint wrote): the same base and
    adapter as the worker's TP=2 export; peft loads them with the merged export's logits."""
    work, ids = run[0], run[3]
    p = run_cli("convert", "--from-megatron", str(work / "run_tp2"), "--to-hf",
                str(tmp_path / "base"), "--peft-adapter", str(tmp_path / "peft"))
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert "holds the checkpoint's base weights (adapters not merged)" in p.stdout
    for mine, theirs in (("base", "base_tp2"), ("peft", "peft_tp2")):
        got, want = load_dir(tmp_path / mine), load_dir(work / theirs)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), mine
    got = _hf_logits(tmp_path / "base", ids, adapter=tmp_path / "peft")
    assert (got - _hf_logits(work / "export_tp2", ids)).abs().max().item() <= 1e-5


def test_peft_adapter_refused_without_lora(tmp_path):
    """--peft-adapter of a checkpoint without adapters, or without --from-megatron: refused
    before any rank starts."""
    from megagrpo.cli import build_parser, cmd_convert

    (tmp_path / "ckpt").mkdir()
    from megagrpo.checkpoint import MODEL_JSON

    (tmp_path / "ckpt" / MODEL_JSON).write_text(json.dumps({"model": {}}))
    args = build_parser().parse_args(["convert", "--from-megatron", str(tmp_path / "ckpt"),
                                      "--to-hf", str(tmp_path / "hf"), "--peft-adapter",
                                      str(tmp_path / "peft")])
    with pytest.raises(SystemExit, match="holds no LoRA adapters"):
        cmd_convert(args)
    args = build_parser().parse_args(["convert", "--from-hf", str(tmp_path / "x"),
                                      "--to-megatron", str(tmp_path / "m"), "--peft-adapter",
                                      str(tmp_path / "peft")])
    with pytest.raises(SystemExit, match="--peft-adapter"):
        cmd_convert(args)


# ---------------------------------------------------------------------- MoE experts
MOE_FUSED = {**FUSED, "gate_proj": "fc1", "up_proj": "fc1"}


def _moe_adapters(work, tag):
    values, grads = {}, {}
    for r in range(2):
        d = torch.load(work / f"{tag}_rank{r}.pt")
        values.update(d.get("values", d))
        grads.update(d.get("grads", {}))
    return values, grads


def merged_weights(model, leaves) -> dict[str, torch.Tensor]:
    """{parameter name: W + s B A} of transformers' MoE model for the adapters `leaves`
    ({HF projection: (A, B)}): per-expert projections (`mlp.experts.N.gate_proj`) land in
    transformers 5's 3D expert tensors (gate_up_proj [E, 2I, H] = cat(gate, up) per expert,
    down_proj [E, H, I]); everything else is a plain linear's weight."""
    import re

    params = dict(model.named_parameters())
    delta, experts = {}, {}
    for name, (a, b) in leaves.items():
        d = SCALE * b @ a
        m = re.match(r"(.*\.mlp\.experts)\.(\d+)\.(\w+)$", name)
        if m:
            experts.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = d
        else:
            delta[name + ".weight"] = d
    for prefix, per in experts.items():
        n = range(len(per))
        delta[prefix + ".gate_up_proj"] = torch.stack(
            [torch.cat([per[e]["gate_proj"], per[e]["up_proj"]]) for e in n])
        delta[prefix + ".down_proj"] = torch.stack([per[e]["down_proj"] for e in n])
    return {name: params[name] + d for name, d in delta.items()}


def moe_reference_grads(model, values, ids, labels):
    """Float64 transformers Qwen2-MoE with each adapter merged into its weight as a function of
    A and B (W + s B A, through torch.func.functional_call: the same gradients as the adapter
    beside the linear); one A per fused megatron linear (per expert for the experts)."""
    model = copy.deepcopy(model).double()
    model.config._experts_implementation_internal = "eager"  # grouped_mm has no float64
    for p in model.parameters():
        p.requires_grad_(False)
    a_leaf, leaves = {}, {}
    for name, v in values.items():
        layer, part = name.rsplit(".", 1)
        key = (layer, MOE_FUSED[part])
        if key not in a_leaf:
            a_leaf[key] = v["A"].clone().requires_grad_()
        leaves[name] = (a_leaf[key], v["B"].clone().requires_grad_())
    logits = torch.func.functional_call(model, merged_weights(model, leaves), (ids,)).logits
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).backward()
    return {n: {"A": a.grad, "B": b.grad} for n, (a, b) in leaves.items()}


def test_expert_adapter_grads_equal_float64_reference(run):
    """EP=2 (dense DP=2, each rank its own row): the reduced gradients of every adapter (4
    routed experts over 2 EP ranks, the shared expert, the dense layer, attention) equal the
    float64 reference's; the router gets none, nor does any base weight."""
    work = run[0]
    values, grads = _moe_adapters(work, "moe_ep2")
    # layer 0: q, k, v, o + 4 experts x (gate, up, down) + shared (gate, up, down); layer 1
    # (dense): q, k, v, o, gate, up, down
    assert len(values) == len(grads) == 19 + 7
    assert not any(n.endswith("mlp.gate") for n in values)  # the router is no target
    _assert_moe_grads_are_the_reference(work, values, grads)
    rows = [r for r in run[1] if r.get("tag") == "moe_ep2"]
    assert len(rows) == 2 and all(r["step_ok"] and r["base_with_grad"] == [] for r in rows)
    for r in rows:  # each EP rank: its 2 experts' adapters, counted as the planner counts
        assert r["opt_numel"] == r["adapter_numel"] == r["planned_numel"]


def _assert_moe_grads_are_the_reference(work, values, grads) -> None:
    """Each adapter's reduced A and B gradients within 1e-5 (relative) of the float64
    reference's: the HF Qwen2-MoE with the adapters' `values`, on ref_moe.pt's rows."""
    from transformers import AutoModelForCausalLM

    ref = torch.load(work / "ref_moe.pt")
    model = AutoModelForCausalLM.from_pretrained(str(work / "qwen2_moe"), dtype=torch.float32)
    want = moe_reference_grads(model, values, ref["ids"], ref["labels"])
    for name, g in grads.items():
        for which in ("A", "B"):
            w = want[name][which]
            err = ((g[which] - w).abs().max() / w.abs().max()).item()
            assert err < 1e-5, (name, which, err)


def test_expert_adapters_reshard_ep2_to_ep1(run):
    """Saved at EP=2 (after the merge checks), loaded at EP=1: every expert's A and B; the peft
    export at either layout is the same folder."""
    work = run[0]
    saved, _ = _moe_adapters(work, "moe_saved")
    loaded, _ = _moe_adapters(work, "moe_ep1_loaded")
    assert saved.keys() == loaded.keys() and len(saved) == 26
    for name in saved:
        for which in ("A", "B"):
            assert torch.equal(saved[name][which], loaded[name][which]), (name, which)
    for ep2, ep1 in (("peft_moe", "peft_moe_ep1"), ("base_moe", "base_moe_ep1")):
        a, b = load_dir(work / ep2), load_dir(work / ep1)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), ep2


def test_expert_peft_export_merges_to_the_merged_export(run):
    """The peft folder names every expert's adapters as peft does on the per-expert HF modules
    (`mlp.experts.N.gate_proj`, `mlp.shared_expert.down_proj`); base + s B A of each equals
    the merged export's weight, and B is not zero (the export is not the base's)."""
    work = run[0]
    peft, base, merged = (load_dir(work / d) for d in ("peft_moe", "base_moe", "export_moe"))
    assert "base_model.model.model.layers.0.mlp.experts.3.down_proj.lora_B.weight" in peft
    assert "base_model.model.model.layers.0.mlp.shared_expert.gate_proj.lora_A.weight" in peft
    assert not any(".mlp.gate." in k for k in peft)
    n = 0
    for key, a in peft.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        b = peft[key.replace("lora_A", "lora_B")]
        want = base[module + ".weight"].double() + SCALE * b.double() @ a.double()
        got = merged[module + ".weight"].double()
        assert (got - want).abs().max().item() <= 1e-6 * want.abs().max().item(), module
        n += b.abs().max().item() > 0
    assert n == 26


def test_attention_adapter_grads_under_sequence_parallelism_moe(run):
    """Qwen2-MoE at TP=2 with sequence parallelism (on by default for an MoE at tp > 1; the
    adapters' input is each rank's slice of the sequence): the reduced gradients of the
    attention adapters (qkv, proj; both rows on both ranks) equal the float64 reference's."""
    work = run[0]
    values, grads = _moe_adapters(work, "moe_tp2_sp")
    assert len(values) == len(grads) == 2 * 4  # two layers x (q, k, v, o)
    rows = [r for r in run[1] if r.get("tag") == "moe_tp2_sp"]
    assert len(rows) == 2 and all(r["step_ok"] and r["sequence_parallel"] for r in rows)
    _assert_moe_grads_are_the_reference(work, values, grads)
