"""The iterative GRPO trainer at TP=2 x PP=2 with real vLLM engines (one rank launch, see
tests/_trainer_worker.py): the reference reset is an exact in-place copy, alpha mixing follows
its formula, a resumed run keeps the reference schedule, async mode trains one step off-policy,
and vLLM's sampling log-probs agree with the sharded trainer's. Issue 10: KL-in-reward shapes
rewards before the group advantages, empty minibatches take no optimizer step, eval accuracy is
the correctness term's, and bad rewards / gradients skip the update, then stop with a checkpoint."""
import json
import math
import os

import pytest

from tests.support.launch import run_ranks

WORKER = os.path.join(os.path.dirname(__file__), "_trainer_worker.py")


@pytest.fixture(scope="module")
def trainer_work(tmp_path_factory):
    work = tmp_path_factory.mktemp("trainer")
    run_ranks(WORKER, 4, "--work", str(work), timeout=900)
    return work


@pytest.fixture(scope="module")
def results(trainer_work):
    return json.loads((trainer_work / "results.json").read_text())


def test_every_parameter_moves_after_one_step(results):
    for r in results:
        assert r["unchanged_params"] == [], r["unchanged_params"]


def test_vllm_logprobs_match_sharded_trainer(results):
    assert results[0]["gap_step1"] < 1e-4


def test_vllm_greedy_equals_megatron_argmax_loop_before_and_after_update(results):
    for r in results:
        meg0, vllm0 = r["greedy_initial"]
        meg1, vllm1 = r["greedy_after_step"]
        assert meg0 == vllm0 and meg1 == vllm1
        assert meg0 != meg1  # the update changed the policy, and vLLM follows it


def test_reshard_peak_memory_is_one_bucket_plus_a_tensor(results):
    for r in results:
        peak, bucket, largest = r["reshard_peak"]
        # one bucket buffer (a bucket holds one tensor when that exceeds the bucket size) plus
        # the HF tensors of the parameter being converted
        assert peak <= max(bucket, largest) + largest, (peak, bucket, largest)


def test_reference_reset_in_place_and_exact(results):
    last = [r for r in results if "post_sync_equal" in r]
    assert len(last) == 1  # the last stage's TP rank 0
    r = last[0]
    assert r["pre_sync_max_diff"] > 1e-4  # the policy had moved away from the reference
    assert r["post_sync_equal"] and r["post_sync_valid_tokens"] > 0
    for r in results:
        assert r["sync_reasons"] == ["", "steps"]
        assert r["ref_ptrs_unchanged"]


def test_alpha_mixing_formula(results):
    for r in results:
        assert r["alpha_moved"] and r["alpha_max_err"] < 1e-6


def test_optimizer_steps_torch_fused_adamw_before_and_after_resume(results):
    """Without TE/Apex megatron builds torch's AdamW; megagrpo switches it to the fused kernel
    (tests/test_optim.py checks its arithmetic), also after loading a checkpoint."""
    for r in results:
        assert r["fused_adam"] and all(r["fused_adam"]), r["fused_adam"]
        assert r["fused_adam_after_resume"] == r["fused_adam"]


def test_resume_keeps_reference_schedule(results):
    for r in results:
        assert r["resume_policy_equal"]
        assert r["resume_state"] == [2, 1, 2]  # step, syncs, last sync step
        assert r["resume_sync_reasons"] == ["", "steps"]  # steps 3 and 4


def test_async_is_one_step_off_policy(results):
    r = results[0]
    # synchronous: the batch of step t is sampled by the policy after t-1 updates
    assert all(v == s - 1 for s, v in r["sync_versions"])
    # async: the first async batch is on-policy, later ones come from the previous policy
    steps = [s for s, _ in r["async_versions"]]
    versions = [v for _, v in r["async_versions"]]
    assert versions == [steps[0] - 1, steps[0] - 1, steps[0]]


def test_async_stale_batches_are_importance_corrected(results):
    """Issue 30: with the default algo.rollout_is=none, the stale async batches (lag 1) train
    with the decoupled correction (weights min(pi_old / vLLM, cap), not all 1: the policy moved)
    and their vLLM gap is reported as the stale one; the fresh first batch is uncorrected and
    reports the same-weights gap."""
    rows = results[0]["async_offpolicy"]
    assert [r[:4] for r in rows] == [[0, 0, True, False], [1, 1, False, True],
                                     [1, 1, False, True]], rows
    for lag, _, _, _, weight, gap in rows[1:]:
        assert gap > 1e-4 and weight != 1.0 and 0.5 < weight < 2.0, rows


def test_k2_stream_stays_within_its_bound(results):
    """Issue 30: rollout.max_staleness=2 after a k = 1 phase left one batch queued: the lags
    are 1, 1, then 2 (the second batch the side thread drew at the first k = 2 step), never
    above k, every sample's (staleness_max) included; the queue held 1, then 2 batches; nothing
    dropped; the stale batches ran the decoupled correction."""
    rows = results[0]["k2_stream"]
    assert [r[0] for r in rows] == [1, 1, 2] and [r[1] for r in rows] == [1, 1, 2], rows
    assert [r[2] for r in rows] == [1, 1, 2], rows  # one version per batch here
    assert [r[3] for r in rows] == [1, 2, 2] and all(r[4] == 0 for r in rows), rows
    assert all(r[5] == 1 and r[6] and r[7] for r in rows), rows


def test_mu_passes_minibatches_and_rollout_is(results):
    r = results[0]["offpolicy"]
    assert r["opt_steps"] == 4  # mu=2 passes x 2 minibatches
    assert r["old_vs_vllm_gap"] < 1e-4  # trainer's old log-probs = vLLM's sampling log-probs
    assert abs(r["is_weight_mean"] - 1.0) < 1e-3
    assert r["ratio_mean"] != 1.0  # later optimizer steps see a moved policy
    # finite (NaN and inf fail) and bounded: per token |A| <= (G-1)/sqrt(G) = 1.5 (G=4, unbiased
    # std), the dual clip caps a negative-advantage token at c|A| = 4.5, the truncated IS weight
    # at 2, and beta * k3 <= 0.05 * kl_clamp_output 10: |loss| <= 2 * 4.5 + 0.5
    assert math.isfinite(r["loss"]) and abs(r["loss"]) <= 9.5, r


def test_dynamic_sampling_gspo_kl_in_reward_batch_std_step(results):
    v = results[0]["variants"]
    assert v["resample_rounds"] is not None and v["filtered_groups"] is not None
    # finite (NaN and inf fail): k3 is >= 0 and capped per token at kl_clamp_output (10); the
    # loss (mu=1, one minibatch: the sequence ratio is 1 up to rounding, the old log-probs
    # coming from a scoring pass over the same weights; beta 0 in the loss under KL-in-reward)
    # is -mean(A) over group-centred advantages, 0 up to rounding
    assert math.isfinite(v["kl"]) and 0.0 <= v["kl"] <= 10.0, v
    assert math.isfinite(v["loss"]) and abs(v["loss"]) < 1e-5, v  # measured ~1e-8


def test_kl_in_reward_shapes_rewards_before_group_advantages(results):
    """On the last stage, after the real scoring pass: advantages = group-normalised
    (reward - beta * summed k3 of old vs reference), to float64 precision."""
    checks = [r["kl_in_reward"] for r in results if r["kl_in_reward"] is not None]
    assert len(checks) == 1  # the last stage's TP rank 0
    assert checks[0]["max_err"] < 1e-5 and checks[0]["moved"] > 1e-4, checks[0]


def test_empty_minibatches_are_skipped_without_an_optimizer_step(results):
    r = results[0]["empty_minibatches"]
    assert r["rows"] == 8 and r["skipped"] == 4 and r["opt_steps"] == 4, r
    assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0


def test_eval_accuracy_ignores_bonus_terms(results):
    """3 of the 8 held-out answers are the greedy completions (tests/_trainer_worker.py:
    known_share_eval): evaluate() reports 3/8 on every rank, as the task's own check scores the
    completions decoded in the worker, although the summed reward is >= 1 everywhere."""
    for r in results:
        e = r["eval_accuracy"]
        assert e["expected"] == 3 / 8, e
        assert e["accuracy"] == e["reference"] == e["expected"], e


def test_bad_rewards_and_nonfinite_grads_skip_the_update_then_stop(results):
    for r in results:
        b = r["bad_steps"]
        assert b["rewards_step"] == {"nonfinite_rewards": 16.0, "update_skipped": 1.0,
                                     "nonfinite_grad": 0.0, "bad_steps_in_a_row": 1}, b
        assert b["raised"] and b["grad_step"]["nonfinite_grad"] >= 1, b
        assert b["grad_step"]["nonfinite_rewards"] == 0
        assert b["grad_step"]["bad_steps_in_a_row"] == 2
        assert b["params_unchanged"] and b["opt_steps"] == 0 and b["versions"] == 0, b
        assert "run.max_bad_steps" in b["message"]


def test_stop_after_bad_steps_saves_a_checkpoint_and_exits(results, trainer_work):
    stops = [json.loads((trainer_work / f"stop_rank{r}.json").read_text()) for r in range(4)]
    step = stops[0]["step"]
    for s in stops:
        assert s["step"] == step and "run.max_bad_steps" in s["message"], s
        assert f"step_{step:06d}" in s["message"]
    assert (trainer_work / "run" / "checkpoints" / f"step_{step:06d}").is_dir()


def test_multi_turn_trains_on_vllm_ids_with_env_tokens_masked(results):
    """Issue 29: 3-turn trajectories (tests/_agent_env.py): every model segment the trainer
    scores is bitwise what vLLM sampled for that turn's prefix (ids and log-probs); the
    vLLM-vs-trainer gap over model tokens is as small as single-turn's; the step's loss is
    finite."""
    for r in results:
        mt = r["multi_turn"]
        assert mt["checked"] > 0 and mt["mismatches"] == 0, mt
    mt = results[0]["multi_turn"]
    assert mt["most_turns"] == 3 and mt["turns"] > 1.5 and mt["env_token_share"] > 0, mt
    assert mt["gap"] < 1e-4 and math.isfinite(mt["loss"]), mt


def test_multi_turn_partial_rollouts_pause_mid_turn_and_between_turns(results):
    """Issue 47 item 1, multi-turn (tests/_partial_check.py:agent_partial_check): at k = 1 with
    a weight update landing in the middle of each side-thread draw, trajectories are paused
    mid-turn and between turns and continued with the new weights; in every trained batch
    every model token's vLLM log-prob equals the sharded trainer's under the weights of its
    stamped version (~1e-7; stamping them all with the newest version would not hold), the
    loss mask is exactly the model's ids (rebuilt from the ids and the environment's rule),
    and the steps train (finite losses). The collector's checkpoint state with the last draw
    paused (live environments in it) saves and loads; paused trajectories whose environment
    saves its state go on where they were, the others restart from their prompt, counted, and
    the batch then ends whole."""
    checked = 0
    for r in results:
        got = r["agent_partial"]
        rows = got["batches"]
        assert len(rows) >= 3 and all(row[4] for row in rows), rows  # the mask, exactly
        assert all(math.isfinite(x) for x in got["losses"]), got
        # paused mid-turn, paused between turns, and spanning an update: all counted
        assert sum(row[1] for row in rows) > 0 and sum(row[2] for row in rows) > 0, rows
        assert sum(row[3] for row in rows) > 0, rows
        # the checkpoint of a collector holding paused trajectories (live environments):
        # saved and loaded; those whose environment saved its state go on where they were
        # (ids kept, no turn asked twice: DigitsSaved would raise), the others restart from
        # the prompt, counted; the batch then whole, every mask exactly Digits'
        paused, lost, restarted, whole, total, kept, same, errors, exact = got["resume"]
        assert paused > 0 and lost > 0 and restarted == lost and whole == total > 0, got
        assert kept > 0 and same and errors == 0 and exact == total, got
        for _, _, _, spanning, _, per_version, as_final in rows:
            if per_version is None:  # not the last stage's TP rank 0
                continue
            checked += 1
            assert max(per_version.values()) < 1e-5, rows
            if spanning:
                assert as_final > 5e-4, rows
    assert checked >= 3


def test_inflight_updates_enter_the_running_draw(results):
    """Issue 30 item 3 at k = 2 (tests/_inflight_check.py): the trainer's post (gathered on the
    main thread: TP gathers, PP broadcasts) entered every draw between decode steps; the batch
    drawn at the first in-flight step, trained two steps later, mixes two versions per sample
    (token lags 2 and 1, so 1 < mean < 2, oldest within k: nothing dropped); after every step
    the engine holds the trainer's version, and vLLM's greedy decode equals megatron's."""
    for r in results:
        got = r["inflight"]
        rows = got["steps"]
        assert [row[0] for row in rows] == [1.0, 1.0, 1.0], rows  # loaded mid-generation
        assert all(row[5] and row[4] == 0 and row[3] <= 2 for row in rows), rows
        assert rows[0][2] == rows[1][2] == 0 and rows[2][2] > 0, rows
        assert 1.0 < rows[2][1] < 2.0, rows
        assert got["queued"] > 0 and got["queued_tokens_ok"] and got["queued_mixed"] > 0, got
        meg, vllm_ids = got["greedy_after"]
        assert meg == vllm_ids


def test_partial_rollouts_stamp_each_token_with_the_weights_that_sampled_it(results):
    """Issue 47 item 1 at k = 2 (tests/_partial_check.py): draws held until the trainer's join
    pause at the weight update and continue with the new weights. In every trained partial
    batch each token's vLLM log-prob equals the sharded trainer's under the weights of the
    version it is stamped with (fp32); stamping every token with the batch's newest version
    would not hold (a gap far above it). Without a cap some trajectory spans 2 updates (k);
    at rollout.partial_max_updates = 1 none of the batches drawn under it spans more than 1,
    and some span 1. Token lags stay within k."""
    checked = 0
    for r in results:
        got = r["partial"]
        assert got["queue_whole"], got
        rows = got["batches"]
        assert len(rows) >= 6, rows
        for cap, span, spanning, lag_lo, lag_hi, per_version, as_final in rows:
            assert 0 <= lag_lo <= lag_hi <= 2, rows
            if per_version is None:  # not the last stage's TP rank 0
                continue
            checked += 1
            assert max(per_version.values()) < 1e-4, rows
            if span > 0:
                assert as_final > 5e-4, rows
        uncapped = [row for row in rows if row[0] == 0]
        assert max(row[1] for row in uncapped) == 2, rows
        clean = [row for row in rows if row[0] == 1][-2:]  # drawn wholly under the cap
        assert len(clean) == 2 and max(row[1] for row in clean) == 1, rows
        assert any(row[2] > 0 for row in clean), rows
    assert checked >= 6
