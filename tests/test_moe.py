"""Mixture of experts (Qwen3-MoE, Qwen2-MoE with a gated shared expert and a dense layer) at
every TP x PP x EP layout of 4 ranks, against transformers' own models (tests/support/tiny.py):
logits, the bitwise HF -> megatron -> HF round trip, and one training step's reduced
gradients (routed experts, router, shared expert, dense) and grad norm, each DP rank on its own
slice of the batch, against a single-process float64 gradient over the whole batch. In the
shared 4-rank launch (tests/conftest.py); see tests/_moe_worker.py."""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from megagrpo.hf import hf_config_dict, hf_shapes, model_config_from_hf
from tests.support.cli import run_cli
from tests.support.docs import assert_generated_table
from tests.support.launch import run_ranks
from tests.support.tiny import edited_copy, load_dir, tiny_dirs, tiny_qwen2_moe, tiny_qwen3_moe
from tests.test_foundation import assert_grads_match, assert_logits_match, reference_grads

LAYOUTS = ["tp1_pp1_ep1", "tp2_pp1_ep2", "tp1_pp2_ep2", "tp1_pp1_ep4"]
MODELS = ["qwen3_moe", "qwen2_moe"]
WORKER = os.path.join(os.path.dirname(__file__), "_moe_worker.py")


def shared_job(work):
    """This module's part of the shared 4-rank launch (tests/conftest.py): the
    tiny MoE models and the batch with transformers' logits under `work`."""
    models = {"qwen3_moe": tiny_qwen3_moe(work / "qwen3_moe"),
              "qwen2_moe": tiny_qwen2_moe(work / "qwen2_moe")}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (8, 12), generator=g)  # DP=4: 2 rows a rank; DP=2: 4
    labels = torch.roll(ids, -1, dims=1)
    ref = {"ids": ids, "labels": labels}
    with torch.no_grad():
        ref.update({f"{n}_logits": m(ids).logits for n, m in models.items()})
    torch.save(ref, work / "ref.pt")
    return [WORKER, "--work", str(work)], (models, ids, labels)


@pytest.fixture(scope="module")
def run(shared_launch):
    work, (models, ids, labels) = shared_launch[__name__]
    grads = {}
    for n, m in models.items():
        g, norm = reference_grads(m, ids, labels)
        grads[n] = per_expert(g), norm
    return work, json.loads((work / "results.json").read_text()), grads


def per_expert(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's 3D expert tensors ([E, 2I, H] gate_up, [E, H, I] down) under the
    checkpoint's per-expert names."""
    out = {}
    for name, g in grads.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base, inter = name[: -len("gate_up_proj")], g.shape[1] // 2
            for e in range(g.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = g[e, :inter]
                out[f"{base}{e}.up_proj.weight"] = g[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(g.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = g[e]
        else:
            out[name] = g
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", MODELS)
def test_moe_logits_match_transformers(run, layout, model):
    assert_logits_match(run[1], layout, model)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", MODELS)
def test_moe_hf_round_trip_bitwise(run, layout, model):
    work, _, _ = run
    src, out = load_dir(work / model), load_dir(work / f"rt_{model}_{layout}")
    assert sorted(src) == sorted(out)
    assert any(".mlp.experts.3.down_proj" in n for n in out)  # every EP rank's experts
    for name, t in src.items():
        assert torch.equal(out[name], t), name


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", MODELS)
def test_moe_reduced_grads_match_single_process(run, layout, model):
    """Expert gradients are reduced over the expert-data-parallel group (DP / EP ranks), dense
    ones over DP, and the experts receive every DP rank's tokens through the all-to-all (each
    DP rank trains on its own slice, so outputs returned to the wrong source rank or a missing
    expert-DP reduction change the gradient): a wrong scale on either, a router whose top-k
    softmax differs from HF's, or a missing shared-expert gate gradient fails here."""
    assert_grads_match(*run, layout, model)


# ------------------------------------------------------------------------------- configs
ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "examples" / "demo.yaml")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    return tiny_dirs(tmp_path_factory.mktemp("moe_families"), "qwen3_moe", "qwen2_moe")


def test_moe_configs_read_and_written(hf_dirs):
    q3 = model_config_from_hf(hf_dirs / "qwen3_moe")
    q2 = model_config_from_hf(hf_dirs / "qwen2_moe")
    assert (q3.architecture, q3.num_experts, q3.moe_topk, q3.moe_ffn_hidden_size,
            q3.moe_norm_topk_prob, q3.qk_norm, q3.qkv_bias) == ("qwen3_moe", 4, 2, 64, True,
                                                                True, False)
    assert (q2.architecture, q2.shared_expert_ffn_hidden_size, q2.moe_norm_topk_prob,
            q2.moe_dense_layers, q2.qkv_bias) == ("qwen2_moe", 48, False, [1], True)
    assert q2.moe_layer_pattern == [1, 0] and q3.moe_aux_loss_coef == 0.001
    for name, m in (("qwen3_moe", q3), ("qwen2_moe", q2)):
        assert set(hf_shapes(m)) == set(load_dir(hf_dirs / name))  # the checkpoint's tensors
        out = hf_dirs / f"written_{name}"
        out.mkdir()
        (out / "config.json").write_text(json.dumps(hf_config_dict(m)))
        assert model_config_from_hf(out) == m
    # a Qwen3-MoE expert count under either key transformers and the released checkpoints use
    cfg = json.loads((hf_dirs / "qwen3_moe" / "config.json").read_text())
    assert cfg.get("num_local_experts", cfg.get("num_experts")) == 4


def test_moe_bad_layouts_refused_before_compute(hf_dirs, tmp_path):
    """Each a one-line error, exit 2, before any process group or model exists."""
    q3 = str(hf_dirs / "qwen3_moe")
    cases = [
        (("verify", "--hf", q3, "--ep", "3"), "parallel.ep=3 does not divide model.num_experts=4"),
        (("convert", "--from-hf", q3, "--to-megatron", str(tmp_path / "m"), "--tp", "4"),
         "parallel.tp=4 does not divide model.num_query_groups=2"),
        (("train", "--config", DEMO, "parallel.ep=2", f"run.out_dir={tmp_path}/r"),
         "expert parallelism needs a mixture-of-experts model"),
        (("train", "--config", DEMO, "--nproc", "1", f"run.init={q3}", "parallel.ep=2",
          f"run.out_dir={tmp_path}/r"), "parallel.ep=2 does not divide the data-parallel size 1"),
        (("train", "--config", DEMO, "model.architecture=qwen3_moe", "model.num_experts=4",
          "model.moe_ffn_hidden_size=96", "parallel.tp=2", "rollout.tensor_parallel_size=2",
          f"run.out_dir={tmp_path}/r"), "96 / rollout.tensor_parallel_size=2 = 48 per vLLM rank"),
        (("verify", "--hf", str(edited_copy(hf_dirs / "qwen3_moe", tmp_path / "yarn",
                                        rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                         "rope_theta": 1e6}))),
         "rope_parameters.rope_type='yarn' is not supported"),
        (("verify", "--hf", str(edited_copy(hf_dirs / "qwen3_moe", tmp_path / "dsv3",
                                        n_group=8))), "n_group=8 is not supported"),
        (("train", "--config", DEMO, "algo.routing_replay=true", f"run.out_dir={tmp_path}/r"),
         "has no experts to route"),
        (("train", "--config", DEMO, f"run.init={q3}", "algo.routing_replay=true",
          "run.async_rollout=true", f"run.out_dir={tmp_path}/r"),
         "checkpointed without its routes"),
    ]
    # two at a time: each is one single-threaded process and the suite leaves a core idle
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = list(pool.map(lambda case: run_cli(*case[0], timeout=120), cases))
    for (args, want), p in zip(cases, done):
        assert p.returncode == 2, (args, p.stdout[-1000:], p.stderr[-2000:])
        assert want in p.stderr and "Traceback" not in p.stderr, (want, p.stderr[-2000:])
        assert not (tmp_path / "r").exists()  # no case made it (none is ever removed)


# ------------------------------------------------------------------------------- verify
@pytest.fixture(scope="module")
def verified(hf_dirs, tmp_path_factory):
    """One 2-rank launch: both families at TP=1 (DP=2) and at EP=2, Qwen2-MoE at TP=2, and
    Qwen3-MoE with routed experts 0 and 1 exchanged (must fail)."""
    out = tmp_path_factory.mktemp("verify_moe") / "codes.json"
    q3, q2 = hf_dirs / "qwen3_moe", hf_dirs / "qwen2_moe"
    jobs = {"q3_tp1": f"{q3}:1:1", "q3_ep2": f"{q3}:1:1:ep2", "q2_tp1": f"{q2}:1:1",
            "q2_tp2": f"{q2}:2:1", "q2_ep2": f"{q2}:1:1:ep2",
            "q3_swapped": f"{q3}:1:1:ep2:experts_swapped"}
    text = run_ranks(str(ROOT / "tests" / "_verify_worker.py"), 2, "--out", str(out),
                    *jobs.values())
    return dict(zip(jobs, json.loads(out.read_text()))), text


def test_moe_verify_passes_at_every_layout_and_fails_on_swapped_experts(verified):
    codes, text = verified
    assert all(codes[k] == 0 for k in codes if k != "q3_swapped"), (codes, text[-6000:])
    assert codes["q3_swapped"] == 1 and text.count("verify: FAILED") == 1
    assert "qwen3_moe, 2 layers, tp=1 pp=1 ep=2" in text
    assert "qwen2_moe, 2 layers, tp=2 pp=1" in text
    # the swap is invisible to the round trip (load and export use the same map): the logits
    # are what catches it
    assert text.count("bitwise equal") == 6


# ------------------------------------------------------------------------------- GRPO
def _grpo(hf_dir: Path, run: Path, *overrides: str):
    p = run_cli("train", "--config", DEMO, "--nproc", "2", f"run.init={hf_dir}", "run.steps=2",
             f"run.out_dir={run}", "data.batch_size=4", "algo.group_size=4",
             "algo.num_minibatches=1", "reference.sync_every_steps=1", "checkpoint.at_end=true",
             "cold_start.steps=0", "eval.every=0", "log.tensorboard=false", "log.progress=false",
             "compute.micro_batch_size=16",
             "reward.terms=[{name: arithmetic}, {name: 'tests._rewards:length_reward', "
             "weight: 0.01}]", *overrides)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return p.stdout, [m for m in metrics if "logp_gap_vllm_mean" in m]


@pytest.mark.parametrize("family,layout", [
    ("qwen3_moe", ("parallel.ep=2", "algo.routing_replay=true")),
    ("qwen2_moe", ("parallel.tp=2", "rollout.tensor_parallel_size=2", "algo.routing_replay=true",
                   "compute.pack_sequences=false"))])
def test_moe_grpo_with_vllm_reference_reset_and_export(hf_dirs, tmp_path, family, layout):
    """2 GRPO steps at 2 ranks (Qwen3-MoE: EP=2, a vLLM engine per rank fed full tensors,
    packed micro-batches; Qwen2-MoE: TP=2 with a TP=2 vLLM engine fed shard to shard, padded
    micro-batches), the reference reset every step, routing replay on. vLLM scores its samples
    as the trainer does before and after an update (step 2 samples from the weights reloaded
    in place after step 1's; a stale expert repack after that reload gave 1.7e-2); in fp32
    the routes vLLM used, replayed in the trainer's order of tokens, are the trainer's own
    everywhere (a transposed [S, B] order gave a 70% mismatch and a 7e-3
    gap); routing statistics are logged, and the export loads in transformers with every
    expert trained."""
    from transformers import AutoModelForCausalLM

    run, out = tmp_path / "run", tmp_path / "export"
    console, steps = _grpo(hf_dirs / family, run, *layout)
    assert len(steps) == 2
    assert all(m["logp_gap_vllm_mean"] < 1e-5 for m in steps), [m["logp_gap_vllm_mean"]
                                                                for m in steps]
    # loads are expert tokens / mean over the experts: 1 is balanced, E / k = 2 the worst
    assert all(1.0 <= m["moe_max_load"] <= 2.0 and 0.0 <= m["moe_min_load"] <= 1.0
               and m["moe_tokens_per_expert"] > 0 and m["moe_load_balancing_loss"] > 0
               for m in steps), steps
    assert all(m["moe_routing_mismatch"] == 0.0 and m["moe_replay_missing"] == 0.0
               for m in steps), steps
    summary = json.loads((run / "summary.json").read_text())
    assert summary["reference_syncs"] == 2
    p = run_cli("convert", "--from-megatron", str(run), "--to-hf", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == family
    src, got = load_dir(hf_dirs / family), load_dir(out)
    assert sorted(src) == sorted(got)
    moved = [k for k in src if ".experts." in k and not torch.equal(src[k], got[k])]
    assert any(".experts.0." in k for k in moved) and any(".experts.3." in k for k in moved)
    # the export knows its EOS (the run's tokenizer), and transformers' generate stops there
    eos = model.generation_config.eos_token_id
    assert eos is not None and eos == json.loads((out / "config.json").read_text())["eos_token_id"]
    prompt = torch.tensor([[1, 5, 7]])
    with torch.no_grad():
        first = int(model(prompt).logits[0, -1].argmax())
        ids = model.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=first,
                             pad_token_id=eos)
    assert ids[0, 3:].tolist() == [first]  # stopped right after the token it was told is EOS


def test_qwen3_30b_a3b_recipe_validates_and_plans_without_weights(capsys):
    """The two-node EP=4 recipe: the published sizes (30.5B, 3.3B active), the routed-expert
    weights per rank at every EP the layout allows, and a plan that fits 80 GiB."""
    from megagrpo.config.train import load_config
    from megagrpo.plan import expert_params, run_plan, total_params

    recipe = str(ROOT / "examples" / "qwen3-30b-a3b-math.yaml")
    cfg = load_config(recipe)
    cfg.validate(world_size=16)
    m = cfg.model
    assert (m.architecture, m.num_experts, m.moe_topk) == ("qwen3_moe", 128, 8)
    assert round(total_params(m) / 1e9, 1) == 30.5
    assert round(total_params(m, active=True) / 1e9, 1) == 3.4  # 3.35B: "A3B"
    # 48 layers x 128 experts x 3 x 768 x 2048, split over tp=2 and ep=4, one pp stage of two
    assert expert_params(m, 2, 4, range(24)) == 24 * 32 * 3 * 768 * 2048 // 2
    assert run_plan(recipe, [], gpus=16, gpu_mem_gib=80) == 0
    out = capsys.readouterr().out
    assert "fits: yes" in out and "3353.0M active per token" in out
    assert "ep=4     32 experts per rank" in out and "<- parallel.ep" in out
    assert "MoE all-to-all buffers" in out


def test_performance_doc_routing_table_is_the_results_table():
    """docs/performance.md's routing-mismatch table is the one moe_routing.py makes from the
    results file."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from moe_routing import table

    got = table(str(ROOT / "benchmarks" / "results" / "moe_routing_cpu.jsonl"))
    assert_generated_table(ROOT / "docs" / "performance.md", "<!-- moe routing table: generated by",
                           "<!-- end of moe routing table -->", got)


def test_performance_doc_moe_throughput_row_is_the_report_row():
    """docs/performance.md's moe throughput row is the one benchmarks/report.py makes from the
    results."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from report import markdown, read_records, summarize

    rows = markdown(summarize(read_records(ROOT / "benchmarks" / "results" /
                                           "throughput_cpu.jsonl"))).splitlines()
    (moe,) = [r for r in rows if r.startswith("| moe | float32 |") and "tok/s" in r]
    assert moe in (ROOT / "docs" / "performance.md").read_text()


def test_moe_routing_benchmark_smallest(tmp_path):
    """benchmarks/moe_routing.py at its smallest: every sampled token's vLLM routing is found
    (the runner-layout hooks map each row to its request and position), and in fp32 vLLM and
    megatron choose the same experts everywhere with a ~1e-7 log-prob gap (a row mapped to the
    wrong token or position would show as a mismatch: the workload's routers are random)."""
    out = tmp_path / "r.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "moe_routing.py"), "--dtypes",
                        "float32", "--prompts", "2", "--group", "2", "--max-tokens", "8",
                        "--out", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["tokens_compared"] == row["sampled_tokens"] > 0
    assert row["routing_mismatch_pairs"] == 0.0 and row["logp_gap_max"] < 1e-5


@pytest.mark.heavy  # grpo_step.py keeps its default-suite smoke tests in test_benchmarks.py
def test_grpo_step_benchmark_moe_smallest():
    """The moe workload through benchmarks/grpo_step.py at 2 prompts x G=8, one step: its
    FLOPs count the top-k experts and the router, not every expert (useful FLOPs of a dense
    model of the active width), so its floor fractions stay below 1."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "grpo_step.py"), "--workload",
                        "moe", "--nprocs", "1", "--warmup", "0", "--steps", "1", "--set",
                        "data.batch_size=2", "--out", ""], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    (row,) = [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert row["workload"] == "moe" and row["max_tokens"] == 32
    assert 0 < row["floor_frac_update"] < 1 and 0 < row["floor_frac_rollout"] < 1


@pytest.mark.heavy
def test_moe_convert_round_trip_tp2_ep2_to_pp2_bitwise(hf_dirs, tmp_path):
    """Through dist-checkpointing: HF -> megatron at TP=2 x EP=2 (4 ranks) -> HF at PP=2,
    every tensor equal, the config read back equal."""
    src = hf_dirs / "qwen3_moe"
    p = run_cli("convert", "--from-hf", str(src), "--to-megatron", str(tmp_path / "m"), "--tp", "2",
             "--ep", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "(tp=2 pp=1 ep=2)" in p.stdout
    p = run_cli("convert", "--from-megatron", str(tmp_path / "m"), "--to-hf", str(tmp_path / "out"),
             "--pp", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = load_dir(src), load_dir(tmp_path / "out")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert model_config_from_hf(tmp_path / "out") == model_config_from_hf(src)
