"""The built-in arithmetic task: splits, answers, reward, tokenizer, build_task."""
import pytest

from megagrpo.config.data import ArithmeticConfig, DataConfig, RewardConfig
from megagrpo.reward import RuleTerms
from megagrpo.tasks import arithmetic, build_task


def test_answers_are_correct_and_splits_disjoint():
    cfg = ArithmeticConfig(digits=2, operators="+-", num_train=3000, num_eval=100, seed=5)
    train, held = arithmetic.train_examples(cfg), arithmetic.eval_examples(cfg)
    assert len(train) == 3000 and len(held) == 100
    assert len({e.prompt for e in held}) == 100  # distinct
    assert not {e.prompt for e in train} & {e.prompt for e in held}
    sft = arithmetic.sft_examples(500, seed=1, cfg=cfg)
    assert not {p for p, _ in sft} & {e.prompt for e in held}
    for e in train[:200] + held:
        expr = e.prompt[:-1]
        op = "+" if "+" in expr else "-"
        a, b = (int(x) for x in expr.split(op))
        assert 0 <= a < 100 and 0 <= b < 100
        assert int(e.answer) == (a + b if op == "+" else a - b) >= 0  # no negatives by default
    assert {e.prompt[-1] for e in train} == {"="}


def test_deterministic_and_seeded():
    cfg = ArithmeticConfig(num_train=50, num_eval=20)
    assert arithmetic.train_examples(cfg) == arithmetic.train_examples(cfg)
    other = ArithmeticConfig(num_eval=20, seed=1)
    assert arithmetic.eval_examples(cfg) != arithmetic.eval_examples(other)
    assert arithmetic.sft_examples(10, 0) == arithmetic.sft_examples(10, 0)
    assert arithmetic.sft_examples(10, 0) != arithmetic.sft_examples(10, 1)


def test_negative_and_multiplication():
    cfg = ArithmeticConfig(digits=1, operators="-*", allow_negative=True, eval_fraction=0.3,
                           num_eval=10, num_train=400)
    answers = {e.prompt: e.answer for e in arithmetic.train_examples(cfg)}
    assert any(a.startswith("-") for a in answers.values())
    for prompt, ans in answers.items():
        op = "*" if "*" in prompt else "-"
        a, b = (int(x) for x in prompt[:-1].split(op))
        assert int(ans) == (a * b if op == "*" else a - b)


def test_reward():
    assert arithmetic.reward("19", "19") == 1.0
    assert arithmetic.reward(" 19 ", "19") == 1.0
    assert arithmetic.reward("191", "19") == 0.0
    assert arithmetic.reward("19=3", "19") == 0.0
    assert arithmetic.reward("19=3", "19", strict=False) == 1.0
    assert arithmetic.reward("-4x", "-4", strict=False) == 1.0
    assert arithmetic.reward("", "0", strict=False) == 0.0
    # the default term
    total, _, metrics = RuleTerms(RewardConfig()).score_texts(["19", "20"], ["19", "19"])
    assert total.tolist() == [1.0, 0.0] and metrics["reward_errors"] == 0


def test_tokenizer_char_level_cached_and_deterministic(tmp_path):
    tok = arithmetic.build_tokenizer(tmp_path / "a")
    assert tok.vocab_size == 19 and (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 2, 3)
    assert tok.encode("12+7=") == [5, 6, 14, 11, 17]  # digit d -> 4 + d, one token per char
    for text in ("98-76=", "3*4=12", "0"):
        assert tok.decode(tok.encode(text)) == text
    model = tmp_path / "a" / arithmetic.TOKENIZER_FILE
    first = model.read_bytes()
    arithmetic.build_tokenizer(tmp_path / "b")
    assert (tmp_path / "b" / arithmetic.TOKENIZER_FILE).read_bytes() == first
    mtime = model.stat().st_mtime_ns
    arithmetic.build_tokenizer(tmp_path / "a")  # cached: not retrained
    assert model.stat().st_mtime_ns == mtime


def test_build_task_and_config_validation(tmp_path):
    task = build_task(DataConfig(), ArithmeticConfig(num_train=64, num_eval=16,
                                                      tokenizer_dir=str(tmp_path)))
    assert len(task.train) == 64 and len(task.eval) == 16
    prompt = task.train[0].prompt
    assert task.tokenizer.decode(task.tokenizer.encode(prompt)) == prompt
    for kw, field in [({"digits": 0}, "digits"), ({"operators": "/"}, "operators"),
                      ({"eval_fraction": 0.0}, "eval_fraction"),
                      ({"digits": 1, "num_eval": 200}, "num_eval")]:
        with pytest.raises(ValueError, match=f"arithmetic.{field}"):
            ArithmeticConfig(**kw).validate()


def test_build_task_from_files(tmp_path):
    arithmetic.build_tokenizer(tmp_path)  # any sentencepiece model will do
    model = str(tmp_path / arithmetic.TOKENIZER_FILE)
    (tmp_path / "train.jsonl").write_text('{"q": "1+2", "a": 3}\n{"q": "4+4", "a": 8}\n')
    (tmp_path / "eval.jsonl").write_text('{"q": "5+5", "a": 10}\n')
    cfg = DataConfig(task="file", path=str(tmp_path / "train.jsonl"),
                     eval_path=str(tmp_path / "eval.jsonl"), prompt_field="q", answer_field="a",
                     template="{prompt}=", tokenizer=model)
    task = build_task(cfg)
    assert [(e.prompt, e.answer) for e in task.train] == [("1+2=", "3"), ("4+4=", "8")]
    assert [(e.prompt, e.answer) for e in task.eval] == [("5+5=", "10")]
    assert task.tokenizer.vocab_size == 19
    with pytest.raises(ValueError, match="data.tokenizer"):
        build_task(DataConfig(task="file", path=str(tmp_path / "train.jsonl")))


def test_cold_start_stops_at_the_target_accuracy(monkeypatch):
    """cold_start.target_accuracy: SFT runs in chunks of check_every steps, each followed by a
    held-out check on freshly synced weights, and stops at the first check that reaches the
    target (steps is the most it runs); the SFT seeds continue across chunks (start offsets);
    without a target it runs all steps with no check."""
    from types import SimpleNamespace

    import megagrpo.train.cold_start as cs
    from megagrpo.config.train import TrainConfig

    calls, accuracies = [], iter([0.1, 0.25, 0.31, 0.9])

    def steps(tr, pairs, n, *, start=0, total=None, **settings):
        calls.append((start, n, total))
        tr.events.append("sft")
        return [1.0] * n

    monkeypatch.setattr(cs, "supervised_steps", steps)

    def trainer(**cold):
        cfg = TrainConfig()
        for k, v in cold.items():
            setattr(cfg.cold_start, k, v)
        cfg.log.progress = False
        tr = SimpleNamespace(cfg=cfg, task=SimpleNamespace(eval=["x"]), reference=None,
                             policy=None, optimizer=None, ranks=SimpleNamespace(rank=0),
                             events=[])
        tr.sync_weights = lambda: tr.events.append("sync")
        tr.evaluate = lambda ex: tr.events.append("eval") or next(accuracies)
        tr.restart_optimizer = lambda: setattr(tr, "optimizer", "fresh optimizer")
        tr.reset_reference = lambda: None
        return tr

    def run(tr):
        return cs.cold_start(tr, logger, tr.cfg.cold_start, tr.cfg.arithmetic,
                             held_out=tr.task.eval, seed=0, progress=False)

    logger = SimpleNamespace(log=lambda rec: None)
    tr = trainer(steps=500, target_accuracy=0.3, check_every=50)
    out = run(tr)
    assert calls == [(0, 50, 500), (50, 50, 500), (100, 50, 500)]
    assert out["sft_steps"] == 150 and out["sft_eval_accuracy"] == 0.31
    assert tr.events == ["sft", "sync", "eval"] * 3 + ["sync"]  # then the GRPO start's sync
    assert tr.optimizer == "fresh optimizer"
    calls.clear()
    tr = trainer(steps=120, target_accuracy=0.0)
    out = run(tr)
    assert calls == [(0, 120, 120)] and out["sft_steps"] == 120
    assert "sft_eval_accuracy" not in out and tr.events == ["sft", "sync"]
