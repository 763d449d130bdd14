"""A real LoRA GRPO run (`megagrpo demo`: 2 ranks, in-process vLLM engines) with the reference
reset after the cold start and after step 2: it completes, a reset is a merge (the next step's
reference equals the policy), vLLM serves the adapters (refit alone between merges, with the
base in the refit that follows one: a reset comes before the step's refit) and
its sampling log-probs stay within fp32 rounding of the trainer's, and the console names the path
that runs. Both refits: the adapters (lora.refit=adapter) and the merged weights W + s B A
(lora.refit=merged, what `auto` picks on vLLM's CPU build), the merged one in bf16 too (base,
adapters and vLLM engine in bf16: the gap and the merge's KL within bf16 rounding). Heavy: a
resume from the run's last checkpoint continues it with the adapters and the schedule."""
import json

import pytest

from tests.support.bf16 import gap_max, needs_fast_bf16
from tests.support.cli import run_cli

COMMON = ("lora.rank=8", "lora.alpha=16", "reference.sync_every_steps=2",
          "cold_start.steps=1",
          "eval.every=0", "arithmetic.num_eval=8", "data.batch_size=8", "algo.group_size=4",
          "algo.num_minibatches=2", "optim.lr=3e-3", "checkpoint.at_end=true",
          # a term with variance in a 1-step cold start's completions (arithmetic is ~all 0)
          'reward.terms=[{name: arithmetic}, {name: format, weight: 0.5, '
          'kwargs: {pattern: "[0-9]+"}}]')


def _demo(out, *extra):
    return run_cli("demo", *COMMON, *extra, f"run.out_dir={out}", timeout=900,
                   OMP_NUM_THREADS=None)  # the launcher picks threads per rank


def _records(out):
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "reference_sync" in r]


BF16 = ("model.dtype=bfloat16", "rollout.dtype=bfloat16", "algo.rollout_is=truncate")


# merged+bf16 is heavy (~25 s): the merged refit's float32 run checks the same steps by default
@pytest.fixture(scope="module", params=["adapter", "merged",
                                        pytest.param("merged+bf16", marks=pytest.mark.heavy)])
def lora_run(request, tmp_path_factory):
    """(out_dir, rc, console, refit, dtype). merged+bf16: the merged refit with a bf16 base and
    vLLM engine (CPUs with native bf16: tests.support.bf16)."""
    refit, _, bf16 = request.param.partition("+")
    if bf16:
        needs_fast_bf16()
    out = tmp_path_factory.mktemp("lora_run") / "run"
    p = _demo(out, "run.steps=2", f"lora.refit={refit}", *(BF16 if bf16 else ()))
    return out, p.returncode, p.stdout + p.stderr, refit, "bfloat16" if bf16 else "float32"


SAYS = {"adapter": "vLLM serves the adapters (LoRA request per rollout)",
        "merged": "vLLM is refit with the merged weights (W + s B A) after each update "
                  "(no adapter-only refit: lora.refit=merged)"}


def test_lora_run_completes_and_says_what_runs(lora_run):
    out, rc, console, refit, _ = lora_run
    assert rc == 0, console[-4000:]
    assert "lora: rank 8, alpha 16" in console, console
    assert SAYS[refit] in console, console


def _peft_adapter_bytes(hf: dict, r: int) -> int:
    """fp32 bytes of a peft adapter on every projection (A repeated per q/k/v and gate/up),
    counted from the engine's HF config by hand."""
    H, F, L = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"]
    hd = hf.get("head_dim") or H // hf["num_attention_heads"]
    q, kv = hf["num_attention_heads"] * hd, hf["num_key_value_heads"] * hd
    per = r * (3 * H + q + 2 * kv) + r * (q + H) + r * (2 * H + 2 * F) + r * (F + H)
    return 4 * L * per


def test_lora_refit_is_adapter_only_between_merges(lora_run):
    """Step 1 follows the cold start's sync (which sent the merged base): its refit is the
    adapters alone; step 2's reset merges before its refit, which so sends the base again.
    Merged refits send the whole model (merged) every time and no adapter."""
    out, rc, console, refit, _ = lora_run
    assert rc == 0, console[-4000:]
    recs = _records(out)
    hf = json.loads((out / "engine" / "rank0" / "config.json").read_text())
    want = _peft_adapter_bytes(hf, 8)
    if refit == "merged":
        assert all("sync_adapter_bytes" not in r for r in recs), recs
        assert recs[0]["sync_bytes"] == recs[1]["sync_bytes"] > 4 * want
        return
    assert [r["sync_adapter_bytes"] for r in recs] == [want, want]
    assert recs[0]["sync_base"] == 0.0 and recs[0]["sync_bytes"] == want
    assert recs[1]["sync_base"] == 1.0 and recs[1]["sync_bytes"] > 4 * want


def test_lora_reset_is_a_merge_and_vllm_stays_in_step(lora_run):
    out, rc, console, _, dtype = lora_run
    assert rc == 0, console[-4000:]
    recs = _records(out)
    assert [r["reference_sync"] for r in recs] == ["", "steps"]
    for r in recs:
        # vLLM sampled with its base and the adapter (LoRA request) or the merged weights; the
        # trainer scores with the adapters: the same policy within the dtype's rounding
        assert r["logp_gap_vllm_mean"] < gap_max(dtype), r
        assert r["update_skipped"] == 0.0 and r["grad_norm"] > 0
    if dtype == "float32":
        # after the cold start's reset B = 0: the reference (adapters off) is the policy,
        # bitwise, until step 1's update moves B
        assert [r["reference_pass_reused"] for r in recs] == [1.0, 0.0]
        return
    # bf16: B keeps the merge's rounding residual, so the reference is the policy rounded once
    # to bf16 (docs/lora.md) and is scored, not taken from the old log-probs; the merge's
    # arithmetic in bf16 is checked against float64 in tests/test_lora_merge.py, and a merged
    # refit that lost the adapters' share would open a gap far above the bound above
    assert recs[0]["reference_pass_reused"] == 0.0


@pytest.mark.heavy
def test_lora_run_resumes_from_its_checkpoint(lora_run):
    out, rc, console, refit, dtype = lora_run
    assert rc == 0, console[-4000:]
    p = _demo(out, "run.steps=3", "run.resume=true", "run.overwrite=false",
              f"lora.refit={refit}", *(BF16 if dtype == "bfloat16" else ()))
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    recs = _records(out)
    assert [r["step"] for r in recs][-1] == 3 and recs[-1]["logp_gap_vllm_mean"] < gap_max(dtype)
