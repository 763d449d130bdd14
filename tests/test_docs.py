"""README config reference vs the dataclasses; every config field documented; every recipe in
examples/ loads and validates at its intended world size (nothing is started)."""
import dataclasses
import re
import subprocess
import typing
from pathlib import Path

import pytest

from megagrpo.config import docs
from megagrpo.config.train import TrainConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RECIPES = sorted((ROOT / "examples").glob("*.yaml"))
# recipes without a `# world_size: N [M ...]` line (owned elsewhere)
WORLD_SIZES = {"demo.yaml": (2,)}


def test_readme_config_reference_is_current():
    text = README.read_text()
    block = text.split(docs.START, 1)[1].split(docs.END, 1)[0]
    assert block == "\n" + docs.render(), (
        "README config reference is stale: python -m megagrpo.config.docs --write README.md")
    assert docs.main(["--check", str(README)]) == 0


def test_every_field_has_a_docstring():
    hints = typing.get_type_hints(TrainConfig)
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    assert names == ["model", "parallel", "optim", "rollout", "algo", "data", "arithmetic",
                     "reward", "reference", "run"]
    for name, cls, rows in docs.sections():
        intro, _ = docs.field_docstrings(cls)
        assert intro, f"{cls.__name__} has no class docstring"
        assert cls is hints[name]
        assert {r.key.split(".")[1] for r in rows if "[]" not in r.key} == {
            f.name for f in dataclasses.fields(cls)}
        missing = [r.key for r in rows if not r.doc]
        assert not missing, f"fields without a docstring: {missing}"


def test_splice_and_check(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{docs.START}\nold\n{docs.END}\n\ntail\n")
    assert docs.main(["--check", str(readme)]) == 1
    assert docs.main(["--write", str(readme)]) == 0
    assert docs.main(["--check", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# x\n\n") and text.endswith(f"{docs.END}\n\ntail\n")
    assert "| `algo.beta` | `float` | `0.04` |" in text
    assert "| `reward.terms[].name` | `str` | `required` |" in text
    with pytest.raises(ValueError, match="markers"):
        docs.splice("no markers", "x")


def _world_sizes(path: Path) -> tuple[int, ...]:
    m = re.search(r"^# world_size:((?: \d+)+)", path.read_text(), re.MULTILINE)
    return tuple(int(w) for w in m.group(1).split()) if m else WORLD_SIZES[path.name]


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_recipe_loads_and_validates(path):
    cfg = load_config(str(path))
    for world in _world_sizes(path):
        cfg.validate(world_size=world)


def test_gpu_recipes_are_what_they_say():
    qwen = load_config(str(ROOT / "examples" / "qwen2.5-0.5b-gsm8k.yaml"))
    assert (qwen.parallel.tp, qwen.parallel.pp, qwen.data.task, qwen.data.template) == (
        1, 1, "file", "chat")
    assert [t.name for t in qwen.reward.terms] == ["math"] and qwen.model.dtype == "bfloat16"
    llama = load_config(str(ROOT / "examples" / "llama3-8b-math.yaml"))
    assert (llama.parallel.tp, llama.parallel.pp) == (4, 2)
    assert llama.reference.sync_every_epoch and llama.algo.loss_agg == "dapo"
    assert llama.algo.dynamic_sampling and llama.algo.eps_high > llama.algo.eps_low
    assert llama.optim.distributed_optimizer  # inherited from base_gpu.yaml


def test_launch_script_parses():
    script = ROOT / "examples" / "launch_multinode.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert "torch.distributed.run" in script.read_text()


def test_config_command_round_trips(tmp_path, capsys):
    from megagrpo.cli import main
    from megagrpo.config.train import to_dict

    recipe = str(ROOT / "examples" / "llama3-8b-math.yaml")
    with pytest.raises(SystemExit) as e:
        main(["config", "--config", recipe, "run.steps=3"])
    assert e.value.code == 0
    resolved = tmp_path / "resolved.yaml"
    resolved.write_text(capsys.readouterr().out)
    assert to_dict(load_config(str(resolved))) == to_dict(load_config(recipe, ["run.steps=3"]))
