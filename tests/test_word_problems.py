"""The word-problem prompt files and the real-model recipe examples/smollm2-135m-math-cpu.yaml:
the held-out operand pairs never occur in training, answers are the sums; the recipe loads,
plans before the model exists, and passes the full preflight (chat template, tokenizer, prompt
lengths, math reward) on the converted SmolLM2 with generated prompt files."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megagrpo.tasks.word_problems import splits, write

RECIPE = Path(__file__).resolve().parent.parent / "examples" / "smollm2-135m-math-cpu.yaml"


def _operands(record):
    a, b = (int(x) for x in re.findall(r"\d+", record["prompt"]))
    return a, b


def test_splits_are_disjoint_and_answers_are_sums():
    train, evals = splits(num_eval=50, seed=3)
    assert len(evals) == 50 and len(train) == 90 * 90 - 50
    assert not {_operands(r) for r in train} & {_operands(r) for r in evals}
    for r in train[:100] + evals:
        assert int(r["answer"]) == sum(_operands(r))
    assert splits(num_eval=50, seed=3) == (train, evals)  # deterministic
    with pytest.raises(ValueError, match="num_eval=0"):
        splits(num_eval=0)


def test_cli_writes_jsonl(tmp_path):
    p = subprocess.run([sys.executable, "-m", "megagrpo.tasks.word_problems", str(tmp_path),
                        "--num-eval", "20"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = (tmp_path / "eval.jsonl").read_text().splitlines()
    assert len(lines) == 20 and set(json.loads(lines[0])) == {"prompt", "answer"}


def test_recipe_loads_and_plans():
    from megagrpo.config.train import load_config
    from megagrpo.plan import run_plan

    cfg = load_config(str(RECIPE), [])
    assert cfg.data.template == "chat" and cfg.reward.terms[0].name == "math"
    assert run_plan(str(RECIPE), [], gpus=1, gpu_mem_gib=16) == 0  # no model on disk needed


def test_recipe_preflight_on_the_real_model(tmp_path):
    from megagrpo.config.train import load_config
    from megagrpo.preflight import preflight
    from tests._smollm2 import smollm2_hf_dir

    hf = smollm2_hf_dir()
    train, evals = write(tmp_path / "data")
    cfg = load_config(str(RECIPE), [f"run.init={hf}", f"data.tokenizer={hf}",
                                    f"data.path={train}", f"data.eval_path={evals}",
                                    f"run.out_dir={tmp_path}/run"])
    checked = preflight(cfg, 1)
    assert len(checked.task.train) == 90 * 90 - 200 and len(checked.task.eval) == 200
    assert checked.model.num_layers == 30 and checked.model.tie_word_embeddings
    assert checked.longest_prompt + cfg.rollout.max_tokens <= cfg.rollout.max_model_len
    assert "<|im_start|>assistant" in checked.task.eval[0].prompt  # the chat template
