"""Recipes, overrides, typed loading and cross-section validation."""
import dataclasses
import json
import os
import re
import typing
from pathlib import Path

import pytest
import yaml

from megagrpo.config.rollout import RolloutConfig
from megagrpo.config.train import TrainConfig, load_config, to_dict

DEMO = os.path.join(os.path.dirname(__file__), "..", "examples", "demo.yaml")
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_demo_recipe_loads_and_validates():
    cfg = load_config(DEMO)
    cfg.validate(world_size=2)
    assert cfg.model.head_dim in (32, 64) and cfg.reference.sync_every_steps > 0


def test_overrides_and_inheritance(tmp_path):
    child = tmp_path / "child.yaml"
    child.write_text(f"base: {(tmp_path / 'base.yaml').name}\nrun:\n  steps: 7\n")
    (tmp_path / "base.yaml").write_text("run:\n  steps: 3\n  seed: 5\nalgo:\n  beta: 0.1\n")
    cfg = load_config(str(child), ["algo.beta=0.2", "reference.alpha=0.5"])
    assert (cfg.run.steps, cfg.run.seed, cfg.algo.beta, cfg.reference.alpha) == (7, 5, 0.2, 0.5)


def test_overrides_index_a_recipe_list(tmp_path):
    """`reward.sources.1.weight=...` sets that field of the recipe's second source; an index
    past the list, or a word where the list needs a number, is refused naming both."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("reward:\n  sources:\n    - {source: rules, weight: 1.0}\n"
                      "    - {source: remote, weight: 0.5, options: {url: 'http://h:1/s'}}\n")
    cfg = load_config(str(recipe), ["reward.sources.1.weight=0.25",
                                    "reward.sources.1.options.timeout_s=3"])
    assert [(s.source, s.weight) for s in cfg.reward.sources] == [("rules", 1.0), ("remote", 0.25)]
    assert cfg.reward.sources[1].options == {"url": "http://h:1/s", "timeout_s": 3}
    for bad, match in [("reward.sources.2.weight=1", r"reward.sources is a list of 2; index it "
                                                      r"with 0..1, got '2'"),
                       ("reward.sources.w.weight=1", r"index it with 0..1, got 'w'"),
                       ("reward.sources.0.source.x=1", r"'source' is not a section")]:
        with pytest.raises(ValueError, match=match):
            load_config(str(recipe), [bad])


@pytest.mark.parametrize("overrides,match", [
    (["run.stepz=1"], r"unknown config key 'run.stepz'; valid keys: \["),
    (["algo.beta=0", "reference.sync_every_steps=5"], r"algo.beta=0 builds no reference"),
    (["reference.alpha=0"], r"reference.alpha=0"),
    (["data.batch_size=3"], r"data.batch_size=3 must be divisible by the data-parallel size 2"),
    (["parallel.tp=3"], r"parallel.tp=3 does not divide model.num_attention_heads"),
    (["compute.kernel_impl=cuda"], r"compute.kernel_impl='cuda'"),
    (["compute.pack_sequences=true", "parallel.attention_impl=megatron"],
     r"compute.pack_sequences=true needs parallel.attention_impl sdpa or auto"),
    (["compute.pack_sequences=true", "compute.micro_batch_tokens=0"],
     r"compute.pack_sequences=true needs a token budget"),
    (["compute.pack_sequences=true", "compute.logits_at_loss_positions=false"],
     r"compute.pack_sequences=true needs compute.logits_at_loss_positions=true"),
])
def test_bad_config_names_the_field(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config(DEMO, overrides).validate(world_size=2)


def test_sequence_packing_runs_where_it_can():
    """Unset, packing is on exactly where its path runs (pp = 1, SDPA attention, its levers
    on); explicit false is always honoured."""
    from megagrpo.model.gpt import sequence_packing

    def packed(*overrides):
        cfg = load_config(DEMO, ["parallel.transformer_impl=local", *overrides])
        return sequence_packing(cfg.compute, cfg.parallel)

    assert packed() and not packed("compute.pack_sequences=false")
    assert not packed("parallel.attention_impl=megatron") and not packed("parallel.pp=2")
    assert not packed("compute.micro_batch_tokens=0")
    assert not packed("compute.trim_micro_batches=false")


# --------------------------------------------------------------------------------- recipes


@pytest.mark.parametrize("text,match", [
    ("run:\n  steps: 3\n   seed: [1\n", r"bad\.yaml:3:\d+: mapping values are not allowed"),
    ("run:\n\tsteps: 3\n", r"bad\.yaml:2:1: tabs are not allowed in YAML, indent with spaces"),
    ("run:\n  steps: 3\n  seed:\t4\n", r"bad\.yaml:3:\d+: tabs are not allowed in YAML"),
    ("- run\n- algo\n", r"recipe .*bad\.yaml: the top level must be a mapping of sections"),
    ("base: bad.yaml\nrun:\n  steps: 3\n", r"bad\.yaml: base: inheritance loops back"),
    ("run: 5\n", r"run=5: expected a mapping of RunConfig settings"),
])
def test_bad_recipe_file_names_file_and_line(tmp_path, text, match):
    (tmp_path / "bad.yaml").write_text(text)
    with pytest.raises(ValueError, match=match):
        load_config(str(tmp_path / "bad.yaml"))


@pytest.mark.parametrize("override,match", [
    ("run.steps=null", r"run\.steps=null: expected an integer"),
    ("run.steps=2.5", r"run\.steps=2\.5: expected an integer"),
    ("run=5", r"run=5: expected a mapping"),
    ("algo.group_size=[1,2]", r"algo\.group_size=\[1, 2\]: expected an integer, got a list"),
    ("algo.group_size=8.5", r"algo\.group_size=8\.5: expected an integer"),
    ("algo.group_size=true", r"algo\.group_size=true: expected an integer, got a boolean"),
    ("algo.mu=1.5", r"algo\.mu=1\.5: expected an integer"),
    ("optim.lr=nan", r"optim\.lr='nan': expected a finite number"),
    ("rollout.temperature=.nan", r"rollout\.temperature=nan: expected a finite number"),
    ("algo.beta=.inf", r"algo\.beta=inf: expected a finite number"),
    ("optim.lr=fast", r"optim\.lr='fast': expected a number"),
    ("run.resume=1", r"run\.resume=1: expected true or false"),
    ("data.template={prompt}", r"data\.template=\{'prompt': None\}: expected a string"),
    ("rollout.stop=abc", r"rollout\.stop='abc': expected a list of strings.*split into characters"),
    ("rollout.stop=[1]", r"rollout\.stop\[0\]=1: expected a string"),
    ("reward.terms=[{name: math, wieght: 2}]",
     r"unknown config key 'reward\.terms\[0\]\.wieght'; valid keys: \[.*\]; did you mean "
     r"reward\.terms\[0\]\.weight\?"),
    ("reward.terms=[{weight: 2}]", r"reward\.terms\[0\]\.name is missing"),
    ("reward.terms=[math]", r"reward\.terms\[0\]='math': expected a mapping"),
    ("reward.terms=[{name: format, kwargs: 5}]", r"reward\.terms\[0\]\.kwargs=5: expected a mapp"),
    ("rollout.n=4", r"rollout\.n is no longer a setting: .* is algo\.group_size"),
    ("run.steps=[", r"override 'run\.steps=\[': the value is not valid YAML"),
])
def test_ill_typed_value_names_field_value_and_type(override, match):
    with pytest.raises(ValueError, match=match):
        load_config(DEMO, [override])


def _wrong_values(hint) -> list:
    """Values no field of annotation `hint` may take (a reference independent of the loader:
    derived from the annotation alone)."""
    if hint is bool:
        return [1, "yes", None]
    if hint is int:
        return [8.5, True, "x", [1], None]
    if hint is float:
        return [float("nan"), float("inf"), True, "x", [1.0], None]
    if hint is str:
        return [5, ["a"], None]
    if typing.get_origin(hint) is list:
        return ["abc", 5, None]
    if hint is dict:
        return [5, "a", None]
    return []


def _leaf_fields():
    """(dotted name, annotation) of every scalar/list field of every config section."""
    for section in dataclasses.fields(TrainConfig):
        cls = typing.get_type_hints(TrainConfig)[section.name]
        for f, hint in typing.get_type_hints(cls).items():
            yield f"{section.name}.{f}", hint


def test_every_field_rejects_values_of_the_wrong_type():
    checked = 0
    for name, hint in _leaf_fields():
        for bad in _wrong_values(hint):
            with pytest.raises(ValueError, match=re.escape(name)):
                load_config(None, [f"{name}={json.dumps(bad)}"])  # NaN, Infinity: strings
            checked += 1
    assert checked > 150  # every section's fields were reached


def test_defaults_and_every_recipe_round_trip_through_yaml(tmp_path):
    """No valid value is rejected: the resolved config, dumped and loaded again, is equal."""
    for recipe in [None, *sorted(str(p) for p in EXAMPLES.glob("*.yaml"))]:
        cfg = load_config(recipe)
        (tmp_path / "dump.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
        assert load_config(str(tmp_path / "dump.yaml")) == cfg


# --------------------------------------------------------------------------------- ranges


@pytest.mark.parametrize("overrides,match", [
    (["optim.min_lr=1e-3"], r"optim\.min_lr=0\.001: need 0 <= min_lr <= optim\.lr=0\.0003"),
    (["optim.adam_beta1=1.0"], r"optim\.adam_beta1=1\.0: need 0 <= beta < 1"),
    (["optim.adam_beta2=-0.1"], r"optim\.adam_beta2=-0\.1: need 0 <= beta < 1"),
    (["optim.adam_eps=-1e-8"], r"optim\.adam_eps=-1e-08: need > 0"),
    (["optim.clip_grad=-1"], r"optim\.clip_grad=-1\.0: need >= 0"),
    (["optim.weight_decay=-0.1"], r"optim\.weight_decay=-0\.1: need >= 0"),
    (["optim.loss_scale=1024"], r"optim\.loss_scale=1024\.0 with model\.dtype='float32': loss "
                                r"scaling applies to model\.dtype=float16 only.*set optim\.loss_"),
    (["model.dtype=float16", "optim.loss_scale=-1"], r"optim\.loss_scale=-1\.0: need a finite"),
    (["model.dtype=float16", "optim.initial_loss_scale=0.5"],
     r"optim\.initial_loss_scale=0\.5 and optim\.min_loss_scale=1\.0: need 0 < min_loss_scale"),
    (["model.dtype=float16", "optim.loss_scale_hysteresis=0"],
     r"optim\.loss_scale_hysteresis=0 must be >= 1"),
    (["eval.every=-1"], r"eval\.every=-1 must be >= 0"),
    (["checkpoint.every=-5"], r"checkpoint\.every=-5 must be >= 0"),
    (["cold_start.lr=-1e-3"], r"cold_start\.lr=-0\.001 must be > 0"),
    (["cold_start.target_accuracy=1.5"], r"cold_start\.target_accuracy=1\.5 must be in \[0, 1\]"),
    (["cold_start.check_every=0"], r"cold_start\.check_every=0 must be >= 1"),
    (["eval.max_tokens=0"], r"eval\.max_tokens=0 must be >= 1"),
    (["rollout.temperature=0"], r"rollout\.temperature=0 is greedy decoding.*> 0"),
    (["rollout.logprobs_mode=raw_logprobs", "rollout.temperature=0.7"],
     r"raw_logprobs with rollout\.temperature=0\.7: vLLM's raw log-probs are taken before"),
    (["data.system_prompt=Be brief."], r"data\.system_prompt is set but data\.template='\{pr"),
    (["data.task=file", "data.path=x.jsonl", "cold_start.steps=5",
      "agent.environment=megagrpo.tasks.arithmetic_tools:CalculatorEnvironment"],
     r"cold_start\.steps=5 with the agent on data\.task='file': .*not a multi-turn"),
    (["data.overlong_prompts=cut"], r"data\.overlong_prompts='cut': use one of \('error', "),
    (["compute.micro_batch_tokens=-1"], r"compute\.micro_batch_tokens=-1 must be >= 0"),
    (["compute.micro_batch_tokens=512", "parallel.pp=2"],
     r"compute\.micro_batch_tokens=512 needs parallel\.pp=1 \(got 2"),
])
def test_out_of_range_value_names_field_and_valid_range(overrides, match):
    cfg = load_config(DEMO, overrides)  # well-typed: loads
    with pytest.raises(ValueError, match=match):
        cfg.validate(world_size=2)


def test_raw_logprobs_is_fine_at_temperature_one():
    load_config(DEMO, ["rollout.logprobs_mode=raw_logprobs"]).validate(world_size=2)


def test_group_size_is_the_only_name_for_g():
    from megagrpo.engine import SamplingSettings

    assert "n" not in {f.name for f in dataclasses.fields(RolloutConfig)}
    cfg = RolloutConfig(temperature=0.5, max_tokens=7, stop=["##"])
    direct = SamplingSettings.from_config(cfg, n=8)  # direct engine users still choose n
    assert (direct.n, direct.temperature, direct.max_tokens, direct.stop) == (8, 0.5, 7, ("##",))
    assert SamplingSettings.from_config(cfg).n == 1


def test_configs_built_in_python_get_the_same_type_checks():
    from megagrpo.config.optim import OptimConfig

    with pytest.raises(ValueError, match=r"optim\.lr=nan: expected a finite number"):
        TrainConfig(optim=OptimConfig(lr=float("nan"))).validate()
    with pytest.raises(ValueError, match=r"rollout\.stop='abc': expected a list of strings"):
        TrainConfig(rollout=RolloutConfig(stop="abc")).validate()
    TrainConfig().validate(world_size=1)


@pytest.mark.parametrize("old, new", [
    ("run.micro_batch_size", "compute.micro_batch_size"),
    ("run.num_minibatches", "algo.num_minibatches"),
    ("run.eval_every", "eval.every"),
    ("run.sft_steps", "cold_start.steps"),
    ("run.checkpoint_every", "checkpoint.every"),
    ("run.heartbeat_timeout_s", "watchdog.heartbeat_timeout_s"),
    ("run.keep_last", "checkpoint.keep_last"),
])
def test_moved_run_keys_point_at_their_new_home(old, new, tmp_path):
    """A recipe written for the old 32-field run section fails at load with the new key, in an
    override and in a YAML file alike; the new key loads."""
    with pytest.raises(ValueError, match=rf"{re.escape(old)} is no longer a setting: .*"
                                         rf"it is {re.escape(new)} now"):
        load_config(None, [f"{old}=1"])
    recipe = tmp_path / "old.yaml"
    recipe.write_text(f"run:\n  {old.split('.')[1]}: 1\n")
    with pytest.raises(ValueError, match=re.escape(new)):
        load_config(str(recipe))
    section, key = new.split(".")
    assert getattr(getattr(load_config(None, [f"{new}=1"]), section), key) == 1


@pytest.mark.parametrize("overrides, match", [
    (["algo.std_eps=0"], r"algo\.std_eps=0\.0: need > 0"),
    (["rollout.top_p=0.9", "algo.rollout_is=truncate"],
     r"rollout\.top_p=0\.9 / rollout\.top_k=-1 with algo\.rollout_is='truncate'"),
    (["rollout.top_k=20", "algo.rollout_is=token_mask"], r"rollout\.top_k=20 with"),
])
def test_step_defects_refused_before_compute(overrides, match):
    """algo.std_eps=0 makes every all-equal group NaN; nucleus/top-k sampling with rollout-IS
    biases every IS weight by the kept mass (vLLM's processed log-probs are renormalised)."""
    with pytest.raises(ValueError, match=match):
        load_config(DEMO, overrides).validate(world_size=2)
    # the same sampling without the IS correction, or with raw log-probs, is fine
    load_config(DEMO, ["rollout.top_p=0.9"]).validate(world_size=2)
    load_config(DEMO, ["rollout.top_p=0.9", "algo.rollout_is=truncate",
                       "rollout.logprobs_mode=raw_logprobs"]).validate(world_size=2)


@pytest.mark.parametrize("backend, cuda, want", [
    ("auto", True, "cpu:gloo,cuda:nccl"), ("nccl", True, "cpu:gloo,cuda:nccl"),
    ("gloo", True, "gloo"), ("auto", False, "gloo"), ("gloo", False, "gloo")])
def test_process_group_backend_keeps_cpu_collectives_on_gloo(backend, cuda, want):
    """On CUDA the default group (and megatron's groups, which inherit its backend string)
    must carry CPU tensors too: the loss normalisers and metric means all-reduce CPU tensors,
    which a plain 'nccl' group refuses. Catches a return to backend='nccl'."""
    from megagrpo.runtime.distributed import process_group_backend

    assert process_group_backend(backend, cuda) == want


def test_process_group_backend_nccl_without_cuda_names_the_field():
    from megagrpo.runtime.distributed import process_group_backend

    with pytest.raises(ValueError, match="parallel.backend='nccl' needs CUDA"):
        process_group_backend("nccl", False)
