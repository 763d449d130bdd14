"""Preflight with the agent on: an environment that cannot be imported or is not an
Environment, and a trajectory budget that does not fit rollout.max_model_len, fail before
compute with one line naming the field."""
import json

import pytest

from megagrpo.config.train import load_config
from megagrpo.preflight import preflight
from megagrpo.tasks import arithmetic


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tok")
    arithmetic.build_tokenizer(d)
    return str(d / arithmetic.TOKENIZER_FILE)


def cfg(tmp_path, spm: str, *overrides: str):
    """Prompts of 6 tokens with BOS ("10+3="), 8 new tokens per turn, 32 in all."""
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"1{k}+3", "answer": "1"}) + "\n"
                            for k in range(4)))
    return load_config(None, [
        "data.task=file", f"data.path={path}", f"data.tokenizer={spm}",
        "data.template='{prompt}='", "data.batch_size=2", "rollout.max_model_len=32",
        "rollout.max_tokens=8", "reward.terms=[{name: exact_match}]",
        f"run.out_dir={tmp_path / 'out'}", *overrides])


def test_environment_must_import_and_be_an_environment(tmp_path, spm_model):
    for name, match in (("no_such_module:Env", "cannot import module 'no_such_module'"),
                        ("tests._agent_env:Nope", "has no attribute 'Nope'"),
                        ("megagrpo.agent.env:Observation", "not a subclass")):
        with pytest.raises(ValueError, match=f"agent.environment='{name}'.*{match}"):
            preflight(cfg(tmp_path, spm_model, f"agent.environment={name}"))


def test_trajectory_budget_must_fit_max_model_len(tmp_path, spm_model):
    env = "agent.environment=tests._agent_env:Digits"
    with pytest.raises(ValueError, match=r"agent.max_total_tokens=27 does not fit "
                                         r"rollout.max_model_len=32 .*\(6 tokens\).* <= 26"):
        preflight(cfg(tmp_path, spm_model, env, "agent.max_total_tokens=27"))
    ok = preflight(cfg(tmp_path, spm_model, env, "agent.max_total_tokens=26"))
    assert ok.longest_prompt == 6
    assert ok.task.train[0].record == {"prompt": "10+3", "answer": "1"}  # for the environment
