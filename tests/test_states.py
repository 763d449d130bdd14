"""The checkpoint manager over a mapping of Stateful parts, and the frozen config.

`CheckpointManager` saves and loads whatever parts it is given: here toy ones on 2 real gloo
ranks (spawned, a file store: no port), a replicated counter and a per-rank tensor whose value
differs by rank. Each rank checks what it got back against the values it saved. At the same
layout both come back; at another the per-rank one does not and the replicated one does; a
per-rank part marked `restore=False` is written but not put back. The config refuses assignment
once `freeze` ran (what `megagrpo.run.train` does after the preflight), naming the dotted key.
"""
import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megagrpo.config.section import FrozenConfigError, freeze, is_frozen
from megagrpo.config.train import load_config

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "examples" / "demo.yaml")
LAYOUT = {"world_size": 2, "tp": 1, "pp": 1, "dp": 2, "rollout_tp": 1}


class Counter:
    """Replicated: the same on every rank."""

    def __init__(self, n: int = 0):
        self.n = n

    def state_dict(self) -> dict:
        return {"count": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["count"]


class RankTensor:
    """Per rank: a tensor whose values depend on the rank."""

    def __init__(self, t: torch.Tensor):
        self.t = t

    def state_dict(self) -> dict:
        return {"t": self.t}

    def load_state_dict(self, state: dict) -> None:
        self.t = state["t"]


def _manager(out: str, counter, mine, skipped, layout=LAYOUT, keep_last=2):
    from megagrpo.checkpoint import CheckpointManager, PerRank, Replicated

    states = {"mine": PerRank(mine, what="the rank's tensor"),
              "skipped": PerRank(skipped, what="a part not restored", restore=False),
              "train_state": Replicated(counter)}
    return CheckpointManager(out, keep_last, states, layout=layout)


def _rank_main(rank: int, store: str, out: str, results: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    saved = torch.arange(4, dtype=torch.float64) + 10 * rank
    counter, mine, skipped = Counter(7), RankTensor(saved.clone()), RankTensor(saved.clone())
    mgr = _manager(out, counter, mine, skipped)
    for step in (1, 2, 3):  # keep_last=2: step 1 is pruned
        counter.n = 7 * step
        mgr.save(step)
    counter.n, mine.t, skipped.t = -1, torch.zeros(4), torch.zeros(4)
    ckpt = mgr.latest()
    restored = mgr.load(ckpt)
    same = {"ckpt": ckpt.name, "count": counter.n, "mine": mine.t.tolist(),
            "skipped": skipped.t.tolist(), "restored": sorted(restored)}
    counter.n, mine.t = -1, torch.zeros(4)
    other = _manager(out, counter, mine, skipped, layout=dict(LAYOUT, dp=1, tp=2))
    restored = other.load(ckpt)
    moved = {"count": counter.n, "mine": mine.t.tolist(), "restored": sorted(restored)}
    Path(results, f"rank{rank}.json").write_text(json.dumps(
        {"same": same, "other": moved, "saved": saved.tolist()}))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    work = tmp_path_factory.mktemp("states")
    out, results = work / "run", work / "results"
    results.mkdir()
    mp.spawn(_rank_main, args=(str(work / "store"), str(out), str(results)), nprocs=2)
    return out, [json.loads((results / f"rank{r}.json").read_text()) for r in range(2)]


def test_same_layout_restores_every_part(two_ranks):
    _, results = two_ranks
    for r in results:
        s = r["same"]
        assert s["ckpt"] == "step_000003" and s["count"] == 21
        assert s["mine"] == r["saved"]  # this rank's own values, not the other rank's
        assert s["skipped"] == [0.0] * 4 and s["restored"] == ["mine"]
    assert results[0]["saved"] != results[1]["saved"]


def test_other_layout_restores_only_the_replicated_parts(two_ranks):
    _, results = two_ranks
    for r in results:
        o = r["other"]
        assert o["count"] == 21 and o["mine"] == [0.0] * 4 and o["restored"] == []


def test_on_disk_format(two_ranks):
    """Per-rank parts as rank files under their names, replicated keys at the top level of
    trainer_state.json beside the manager's, a manifest, keep_last complete checkpoints."""
    from megagrpo.checkpoint import load_tree
    from megagrpo.runtime.run_dir import checkpoint_root, verify

    out, results = two_ranks
    dirs = sorted(p.name for p in checkpoint_root(out).iterdir())
    assert dirs == ["step_000002", "step_000003"]
    ckpt = checkpoint_root(out) / "step_000003"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["count"] == 21 and state["layout"] == LAYOUT and state["world_size"] == 2
    assert "metrics_bytes" in state
    for rank in range(2):
        tree = load_tree(ckpt / "mine" / f"rank{rank:05d}.safetensors")
        assert tree["t"].tolist() == results[rank]["saved"]
        assert (ckpt / "skipped" / f"rank{rank:05d}.safetensors").exists()
    assert verify(ckpt) is None


def test_config_frozen_after_the_checks_refuses_assignment():
    """What `run.train` does: the preflight passes, then the config is frozen; any setting,
    nested list items included, then refuses assignment and names its key; a copy made with
    dataclasses.replace is a new, unfrozen section."""
    from megagrpo.preflight import preflight

    cfg = load_config(DEMO, ["algo.mu=2"])
    preflight(cfg, 2)
    assert not is_frozen(cfg)
    cfg.algo.mu = 1  # before freezing: a plain dataclass
    freeze(cfg)
    with pytest.raises(FrozenConfigError, match=r"^algo\.mu: the config is frozen"):
        cfg.algo.mu = 2
    with pytest.raises(AttributeError, match=r"reward\.terms\[0\]\.weight"):
        cfg.reward.terms[0].weight = 2.0
    model = cfg.model
    with pytest.raises(AttributeError, match=r"^model: "):
        cfg.model = dataclasses.replace(model, num_layers=model.num_layers + 2)
    assert cfg.algo.mu == 1 and cfg.model is model
    copy = dataclasses.replace(cfg.rollout, seed=5)
    copy.seed = 6
    assert copy.seed == 6 and cfg.rollout.seed != 6
    cfg.validate(2)  # a frozen config still checks and compares like the loaded one
    assert cfg == freeze(load_config(DEMO, ["algo.mu=1"]))


class _Stop(Exception):
    pass


def test_setup_freezes_after_the_preflight_and_keeps_the_recipes_model(tmp_path, monkeypatch):
    """`setup(frozen=True)` (what `run.train` calls): by the time the first process group would
    start, the config is frozen, and the architecture the run is built with is run.init's
    (here a tiny HF Llama), passed on as a value while cfg.model stays the recipe's."""
    import megagrpo.run as run
    from tests.support.tiny import tiny_llama

    tiny_llama(tmp_path / "hf", vocab=100, layers=2)
    seen = {}

    def stop(parallel, model, **kw):
        seen.update(frozen=is_frozen(cfg), model=model)
        raise _Stop

    monkeypatch.setattr(run, "init_distributed", stop)
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(k, v)
    cfg = load_config(DEMO, [f"run.init={tmp_path / 'hf'}", f"run.out_dir={tmp_path / 'run'}",
                             "cold_start.steps=0", "data.batch_size=8"])
    recipe_model = dataclasses.replace(cfg.model)
    with pytest.raises(_Stop):
        run.setup(cfg, frozen=True)
    assert seen["frozen"] and seen["model"].vocab_size == 100 and seen["model"].num_layers == 2
    assert cfg.model == recipe_model and cfg.model.vocab_size == 19
    with pytest.raises(FrozenConfigError):
        cfg.run.steps = 1
