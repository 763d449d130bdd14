"""A LoRA run's checkpoints name a base folder beside them (megagrpo.lora.checkpoint): the
manifest's refs are verified with the checkpoint, retention removes a base with the last
checkpoint naming it, and a policy folder whose base is gone says where it should be. Files
only (no ranks); the manager itself runs in tests/_lora_worker.py (tests/test_lora.py) and, end
to end with kill -9, in tests/test_resume.py's heavy LoRA mode."""
import json
import os
import shutil

import pytest

from megagrpo.runtime.run_dir import newest_intact, prune_shared, refs_of, write_manifest


def _base(root, merges: int):
    d = root / f"base_{merges:06d}"
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(os.urandom(2048))
    (d / "megagrpo_model.json").write_text("{}")
    write_manifest(d)
    return d


def _step(root, step: int, base: str):
    d = root / f"step_{step:06d}"
    (d / "policy").mkdir(parents=True)
    (d / "policy" / "__0_0.distcp").write_bytes(os.urandom(256))
    (d / "policy" / "megagrpo_model.json").write_text(json.dumps({"base": f"../../{base}"}))
    (d / "trainer_state.json").write_text(json.dumps({"step": step}))
    write_manifest(d, {"base": f"../{base}"})
    return d


def test_a_checkpoint_is_intact_only_with_its_base(tmp_path):
    b0, b1 = _base(tmp_path, 0), _base(tmp_path, 1)
    s2, s3, s4 = _step(tmp_path, 2, b0.name), _step(tmp_path, 3, b1.name), \
        _step(tmp_path, 4, b1.name)
    assert refs_of(s3) == {"base": "../base_000001"}
    assert newest_intact(tmp_path) == (s4, [])
    shard = b1 / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])  # damaged base: both checkpoints naming it
    ckpt, broken = newest_intact(tmp_path)
    assert ckpt == s2 and [p for p, _ in broken] == [s4, s3]
    assert "the base it names, ../base_000001: __0_0.distcp has 100 bytes" in broken[0][1]
    shutil.rmtree(b0)  # a base that is gone
    assert newest_intact(tmp_path)[0] is None
    assert "the base it names, ../base_000000: missing" in newest_intact(tmp_path)[1][-1][1]


def test_retention_keeps_the_base_a_kept_checkpoint_names(tmp_path):
    """Checkpoint 2 wrote base_000001 and is removed; 3 names it: it stays. base_000000 (named
    by no one) and a leftover of an interrupted write go."""
    _base(tmp_path, 0)
    b1 = _base(tmp_path, 1)
    (tmp_path / "base_000002.tmp").mkdir()
    _step(tmp_path, 3, b1.name)
    removed = prune_shared(tmp_path, ["base"])
    assert sorted(p.name for p in removed) == ["base_000000", "base_000002.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base_000001", "step_000003"]


def test_policy_without_its_base_says_where_it_was(tmp_path):
    from megagrpo.checkpoint import base_folder

    step = _step(tmp_path, 2, "base_000000")
    with pytest.raises(FileNotFoundError, match=r"its base weights, is in \.\./\.\./base_000000"):
        base_folder(step / "policy")
    assert base_folder(_base(tmp_path, 7)) is None  # a whole model: no link to follow
    _base(tmp_path, 0)
    base, holds = base_folder(step / "policy")
    assert base.resolve() == (tmp_path / "base_000000").resolve()
    assert holds == ".lora_"  # a folder written before "holds": LoRA's adapter keys
