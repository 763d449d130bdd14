"""Recipes, overrides and cross-section validation."""
import os

import pytest

from megagrpo.config.train import load_config

DEMO = os.path.join(os.path.dirname(__file__), "..", "examples", "demo.yaml")


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


@pytest.mark.parametrize("overrides,match", [
    (["run.stepz=1"], r"unknown config key 'run.stepz'; valid keys: \["),
    (["algo.beta=0", "reference.sync_every_steps=5"], r"algo.beta=0 builds no reference"),
    (["reference.alpha=0"], r"reference.alpha=0"),
    (["data.batch_size=3"], r"data.batch_size=3 must be divisible by the data-parallel size 2"),
    (["parallel.tp=3"], r"parallel.tp=3 does not divide model.num_attention_heads"),
    (["run.kernel_impl=cuda"], r"run.kernel_impl='cuda'"),
])
def test_bad_config_names_the_field(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config(DEMO, overrides).validate(world_size=2)
