"""docs/config.md's config reference vs the dataclasses; every config field documented; every
relative link in README.md and docs/ resolves; every recipe in examples/ loads and validates at
its intended world size (nothing is started)."""
import dataclasses
import re
import subprocess
import typing
from pathlib import Path

import pytest

from megagrpo.config import docs
from megagrpo.config.train import TrainConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DOC = ROOT / "docs" / "config.md"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# [text](target) and ![alt](target); the target ends at whitespace or ')' (a title may follow)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?[^)]*\)")
RECIPES = sorted((ROOT / "examples").glob("*.yaml"))
# recipes without a `# world_size: N [M ...]` line (owned elsewhere)
WORLD_SIZES = {"demo.yaml": (2,)}


def test_config_reference_is_current():
    text = CONFIG_DOC.read_text()
    block = text.split(docs.START, 1)[1].split(docs.END, 1)[0]
    assert block == "\n" + docs.render(), (
        "docs/config.md is stale: python -m megagrpo.config.docs --write docs/config.md")
    assert docs.main(["--check", str(CONFIG_DOC)]) == 0


def _unfenced(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)


def _links(text: str) -> list[str]:
    """Link targets outside fenced code blocks and inline code spans."""
    return LINK.findall(re.sub(r"`[^`\n]*`", "", _unfenced(text)))


def _anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation but '-' and '_' dropped, spaces -> '-'."""
    heads = re.findall(r"^#{1,6} +(.+?) *#*$", _unfenced(page.read_text()), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def test_relative_links_resolve():
    """Every relative link in README.md and docs/*.md points at an existing file, and an
    anchor into a Markdown page names one of its headings, so splitting or moving a page
    cannot leave dead links behind."""
    assert len(PAGES) > 1
    dead = []
    for page in PAGES:
        for target in _links(page.read_text()):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):
                continue  # http(s):, mailto:, ...
            path, _, anchor = target.split("?", 1)[0].partition("#")
            dest = (page.parent / path) if path else page
            if not dest.exists():
                dead.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                dead.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not dead, f"dead links: {dead}"


def test_every_field_has_a_docstring():
    hints = typing.get_type_hints(TrainConfig)
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    assert names == ["model", "parallel", "optim", "rollout", "sync", "algo", "data", "arithmetic",
                     "reward", "agent", "reference", "lora", "run", "compute", "checkpoint",
                     "eval", "cold_start", "log", "watchdog"]
    for name, cls, rows in docs.sections():
        intro, _ = docs.field_docstrings(cls)
        assert intro, f"{cls.__name__} has no class docstring"
        assert cls is hints[name]
        assert {r.key.split(".")[1] for r in rows if "[]" not in r.key} == {
            f.name for f in dataclasses.fields(cls)}
        missing = [r.key for r in rows if not r.doc]
        assert not missing, f"fields without a docstring: {missing}"


def test_splice_and_check(tmp_path):
    readme = tmp_path / "config.md"
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


def test_architecture_module_map_names_every_module():
    """docs/architecture.md is the one-hop map from a stage to its module: a new module that is
    not in it (or a map entry whose module is gone) fails here."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| ([^|]+) \|", text, re.MULTILINE)  # the first cell: module names
    named = " ".join(rows)
    modules = sorted(p.name for p in (ROOT / "megagrpo").glob("*.py") if p.name != "__init__.py")
    missing = [m for m in modules if m not in named]
    assert not missing, f"modules missing from docs/architecture.md: {missing}"
    for row in rows:
        for path in re.findall(r"megagrpo/[\w/]+\.py", row):
            assert (ROOT / path).is_file(), f"docs/architecture.md names {path}, which is gone"
    for stage in ("rollout", "reward", "advantage", "score", "update", "sync", "reference", "log",
                  "checkpoint"):
        assert re.search(rf"^  -> {stage}\s", text, re.MULTILINE), stage
