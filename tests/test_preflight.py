"""Preflight: every check that needs files or imports fails before any process group, model or
engine exists, naming the field, the value and the fix; the CLI returns rc 2 within seconds."""
import json
import resource
import textwrap
import time
from pathlib import Path

import pytest
import torch

from megagrpo.config.train import load_config
from megagrpo.preflight import preflight
from megagrpo.tasks import arithmetic
from tests.support.cli import run_cli

ROOT = Path(__file__).resolve().parent.parent
DEMO = str(ROOT / "examples" / "demo.yaml")

USER_REWARDS = """
def strict_match(completion, answer, strict=True):
    return float(completion == answer if strict else answer in completion)
"""


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory) -> str:
    """A character-level sentencepiece model (the arithmetic task's: one token per character)."""
    d = tmp_path_factory.mktemp("tok")
    arithmetic.build_tokenizer(d)
    return str(d / arithmetic.TOKENIZER_FILE)


def _jsonl(path: Path, records: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _file_cfg(tmp_path: Path, spm: str, records: list, *overrides: str):
    """A task=file recipe over `records`: prompt + 8 new tokens must fit 32."""
    path = _jsonl(tmp_path / "train.jsonl", records)
    return load_config(None, [
        "data.task=file", f"data.path={path}", f"data.tokenizer={spm}", "data.template='{prompt}='",
        "data.batch_size=2", "rollout.max_model_len=32", "rollout.max_tokens=8",
        "reward.terms=[{name: exact_match}]", f"run.out_dir={tmp_path / 'out'}", *overrides])


def _reference_length(spm: str, text: str) -> int:
    """Prompt tokens as sentencepiece itself counts them, BOS included (independent of
    megagrpo's encode_prompt)."""
    import sentencepiece as spmlib

    return len(spmlib.SentencePieceProcessor(model_file=spm).encode(text, add_bos=True))


# ------------------------------------------------------------------------ prompts and data


def test_overlong_prompts_refused_or_dropped_at_the_exact_budget(tmp_path, spm_model):
    records = [{"prompt": "1" * k, "answer": "1"} for k in range(18, 28)]
    evals = [{"prompt": "2" * k, "answer": "2"} for k in range(18, 30)]
    eval_path = _jsonl(tmp_path / "eval.jsonl", evals)
    over = ["eval.max_tokens=4", f"data.eval_path={eval_path}"]
    lengths = [_reference_length(spm_model, r["prompt"] + "=") for r in records]
    fits = [r["prompt"] + "=" for r, n in zip(records, lengths) if n + 8 <= 32]
    assert 24 in lengths and 25 in lengths  # the boundary is exercised
    with pytest.raises(ValueError, match=(
            rf"{len(records) - len(fits)} of {len(records)} training prompts are longer than "
            r"rollout\.max_model_len=32 - rollout\.max_tokens=8 = 24 tokens.*"
            r"data\.overlong_prompts=drop")):
        preflight(_file_cfg(tmp_path, spm_model, records, *over), 1)
    got = preflight(_file_cfg(tmp_path, spm_model, records, *over,
                              "data.overlong_prompts=drop"), 1)
    assert [e.prompt for e in got.task.train] == fits
    assert got.dropped_train == len(records) - len(fits)
    eval_fits = [e for e in evals if _reference_length(spm_model, e["prompt"] + "=") <= 32 - 4]
    assert len(got.task.eval) == len(eval_fits) and got.dropped_eval == len(evals) - len(eval_fits)
    assert got.longest_prompt == 28  # eval's budget (32 - 4) is the larger one
    assert f"dropped {got.dropped_train} train / {got.dropped_eval} eval prompts" in got.summary()


def test_data_the_tokenizer_cannot_encode_is_named(tmp_path, spm_model):
    """A tokenizer that does not cover the data (stop 38's new user: letters under the
    arithmetic tokenizer, so the reward stayed 0 for 30 steps without a word): one warning per
    field naming the unknown characters, the count and an example; none for covered data."""
    records = [{"prompt": "12+3", "answer": "15"}, {"prompt": "say 7", "answer": "aa"},
               {"prompt": "4*2", "answer": "8"}]
    got = preflight(_file_cfg(tmp_path, spm_model, records), 1)
    assert len(got.warnings) == 2, got.warnings
    prompts, answers = got.warnings
    assert prompts.startswith("1 of 3 training prompts") and "'asy'" in prompts, prompts
    assert "#2: 'say 7='" in prompts, prompts
    assert answers.startswith("1 of 3 training answers") and ": 'a' (e.g. #2: 'aa')" in answers
    assert "cannot be earned" in answers
    ok = preflight(_file_cfg(tmp_path, spm_model, [records[0], records[2]]), 1)
    assert ok.warnings == []
    # a rank that does not print them does not look (run.setup: rank 0 of a plain torchrun)
    assert preflight(_file_cfg(tmp_path, spm_model, records), 1, warn=False).warnings == []


def _chat_tokenizer(path: Path) -> str:
    """A word-level HF tokenizer whose chat template wraps the question in 7 extra tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>", "user", "assistant", ":", "w"]
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>", pad_token="<pad>")
    tok.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>"
                         "{% endfor %}{% if add_generation_prompt %}<s>assistant:{% endif %}")
    tok.save_pretrained(path)
    return str(path)


def test_prompt_budget_counts_the_chat_template(tmp_path, spm_model):
    from transformers import AutoTokenizer

    tok_dir = _chat_tokenizer(tmp_path / "chat_tok")
    records = [{"prompt": " ".join(["w"] * k), "answer": "1"} for k in range(12, 21)]
    hf = AutoTokenizer.from_pretrained(tok_dir)
    # HF's own rendering and encoding; the template starts with BOS, so nothing goes in front
    lengths = [len(hf.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                          tokenize=True, add_generation_prompt=True)
                   ["input_ids"]) for r in records]
    fits = [r["prompt"] for r, n in zip(records, lengths) if n <= 32 - 8]
    assert 0 < len(fits) < len(records)
    over = [f"data.tokenizer={tok_dir}", "data.template=chat", "data.overlong_prompts=drop"]
    got = preflight(_file_cfg(tmp_path, spm_model, records, *over), 1)
    assert [e.prompt.split(": ")[1].split("</s>")[0] for e in got.task.train] == fits
    assert got.longest_prompt == max(n for n in lengths if n <= 24)
    assert got.mean_train_prompt == pytest.approx(sum(n for n in lengths if n <= 24) / len(fits))


@pytest.mark.parametrize("records,match", [
    ([{"prompt": "1+1", "answer": "2"}, {"prompt": None, "answer": "0"}],
     r"train\.jsonl, record 2: data\.prompt_field 'prompt' is null"),
    ([{"prompt": "  ", "answer": "0"}, {"prompt": "1+1", "answer": "2"}],
     r"record 1: data\.prompt_field 'prompt' is '  '; every prompt needs text"),
    ([{"prompt": "1+1", "answer": None}], r"record 1: data\.answer_field 'answer' is null"),
    ([{"prompt": "1+1", "answer": "2"}, {"question": "x", "answer": "1"}],
     r"field 'prompt' not found .*available: \['answer', 'question'\]"),
    ([], r"train\.jsonl holds no records"),
    ([{"prompt": "1+1", "answer": "2"}], r"data\.batch_size=2 needs at least that many training "
                                         r"prompts; .*train\.jsonl gives 1"),
])
def test_bad_records_are_refused(tmp_path, spm_model, records, match):
    with pytest.raises(ValueError, match=match):
        preflight(_file_cfg(tmp_path, spm_model, records), 1)


@pytest.mark.parametrize("override,match", [
    ("data.path=/nonexistent/train.jsonl", r"data\.path='/nonexistent/train\.jsonl': no such file"),
    ("data.eval_path=/nonexistent/eval.jsonl", r"data\.eval_path='/nonexistent/eval\.jsonl'"),
    ("data.tokenizer=/nonexistent/tok.model", r"data\.tokenizer='/nonexistent/tok\.model'"),
    ("run.init=/nonexistent/ckpt", r"run\.init='/nonexistent/ckpt': no such folder; use 'random'"),
])
def test_missing_files_name_the_setting(tmp_path, spm_model, override, match):
    records = [{"prompt": "1+1", "answer": "2"}] * 4
    with pytest.raises(ValueError, match=match):
        preflight(_file_cfg(tmp_path, spm_model, records, override), 1)


def test_init_folder_without_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match=r"run\.init=.* holds neither config\.json nor"):
        preflight(load_config(DEMO, [f"run.init={tmp_path}"]), 2)


# ------------------------------------------------------------------------ rewards


@pytest.fixture
def user_rewards(tmp_path, monkeypatch) -> str:
    (tmp_path / "pf_user_rewards.py").write_text(textwrap.dedent(USER_REWARDS))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "pf_user_rewards"


@pytest.mark.parametrize("terms,match", [
    ("[{name: 'no_such_mod_xyz:score'}]",
     r"reward\.terms\[0\]: reward 'no_such_mod_xyz:score': cannot import module "
     r"'no_such_mod_xyz' .*PYTHONPATH"),
    ("[{name: arithmetic}, {name: 'pf_user_rewards:strict_match', kwargs: {strictt: false}}]",
     r"reward\.terms\[1\]: .*unexpected keyword argument 'strictt'.*accepts strict after"),
    ("[{name: 'pf_user_rewards:no_such_fn'}]", r"pf_user_rewards has no attribute 'no_such_fn'"),
    ("[{name: format}]", r"reward\.terms\[0\]: .*missing a required argument: 'pattern'"),
    ("[{name: exact_match, kwargs: {patern: x}}]", r"unexpected keyword argument 'patern'"),
    ("[{name: nonsense}]", r"reward 'nonsense': use one of \["),
])
def test_reward_terms_resolve_and_bind_before_start(user_rewards, terms, match):
    from megagrpo.reward import RuleTerms

    cfg = load_config(DEMO, [f"reward.terms={terms}"])
    with pytest.raises(ValueError, match=match):
        preflight(cfg, 2)
    with pytest.raises(ValueError, match=match):  # the direct API refuses the same
        RuleTerms(cfg.reward)


def test_reward_keywords_that_bind_pass(user_rewards):
    cfg = load_config(DEMO, ["reward.terms=[{name: 'pf_user_rewards:strict_match', "
                             "kwargs: {strict: false}}, {name: format, kwargs: {pattern: '.*'}}]"])
    preflight(cfg, 2)


# ------------------------------------------------------------------------ model


@pytest.mark.skipif(torch.cuda.is_available(), reason="vLLM's CPU attention limit only")
def test_head_dim_unsupported_by_vllm_cpu():
    with pytest.raises(ValueError, match=r"head_dim=48 is not supported by vLLM's CPU attention"):
        preflight(load_config(DEMO, ["model.head_dim=48"]), 2)


def test_unservable_lora_adapter_refit_is_refused_before_compute():
    """lora.refit=adapter on a layout vLLM cannot serve adapters on is refused by the
    preflight (no process group, no engine), naming the field and the fix. Engines of TP 2
    serve them (tests/test_separate_tp.py checks the gap): not refused."""
    preflight(load_config(DEMO, ["lora.rank=8", "lora.refit=adapter",
                                 "rollout.tensor_parallel_size=2"]), 2)
    # an MoE model on vLLM's CPU build: with LoRA on its experts need Triton (measured at the
    # first generate), so even attention-only adapters are refused here, at either placement
    for placement in (["rollout.placement=colocated"],
                      ["rollout.placement=separate", "rollout.rollout_ranks=1"]):
        with pytest.raises(ValueError, match=r"lora.refit=adapter, but an MoE model on vLLM's "
                                             r"CPU build.*set lora.refit=auto or merged"):
            preflight(load_config(DEMO, ["lora.rank=8", "lora.refit=adapter",
                                         "lora.targets=[qkv, proj]", *placement,
                                         "model.architecture=qwen3_moe", "model.num_experts=4",
                                         "model.moe_topk=2", "model.moe_ffn_hidden_size=64"]),
                      3 if placement[0].endswith("separate") else 2)


def test_layout_and_lengths_are_checked_against_run_init(tmp_path):
    """The recipe's model section is ignored with an HF run.init: TP and max_model_len are
    checked against the checkpoint's architecture (4 heads, 2 KV groups, 256 positions)."""
    from tests.support.tiny import tiny_llama

    tiny_llama(tmp_path)
    ok = ["model.num_attention_heads=8", "model.num_query_groups=8", "model.hidden_size=256",
          "data.batch_size=4", f"run.init={tmp_path}"]
    load_config(DEMO, ok + ["parallel.tp=4"]).validate(world_size=4)  # the recipe alone is fine
    with pytest.raises(ValueError, match=r"parallel\.tp=4 does not divide model\.num_query_gro"):
        preflight(load_config(DEMO, ok + ["parallel.tp=4"]), 4)
    with pytest.raises(ValueError, match=r"rollout\.max_model_len=512 exceeds the model's "
                                         r"max_position_embeddings=256"):
        preflight(load_config(DEMO, ok + ["rollout.max_model_len=512"]), 2)
    assert preflight(load_config(DEMO, ok), 2).model.num_query_groups == 2


def test_demo_passes_preflight_in_seconds():
    cpu = time.process_time()  # CPU, not wall: the test machine is shared
    got = preflight(load_config(DEMO), 2)
    cpu = time.process_time() - cpu
    assert (len(got.task.train), len(got.task.eval), got.dropped_train) == (20000, 200, 0)
    assert got.longest_prompt == max(len(e.prompt) for e in got.task.train) + 1  # chars + BOS
    assert got.mean_train_prompt == pytest.approx(
        sum(len(e.prompt) + 1 for e in got.task.train) / 20000)
    assert cpu < 5.0, f"{cpu:.1f} CPU s: {got.summary()}"


def test_setup_runs_the_same_checks_before_any_process_group(tmp_path, monkeypatch):
    import torch.distributed as dist

    from megagrpo.run import setup

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    cfg = load_config(DEMO, ["data.task=file", "data.path=/nonexistent/x.jsonl",
                             "cold_start.steps=0", f"run.out_dir={tmp_path}"])
    with pytest.raises(ValueError, match=r"data\.path='/nonexistent/x\.jsonl'"):
        setup(cfg)
    assert not dist.is_initialized()


# ------------------------------------------------------------------------ the command line


def _train(tmp_path: Path, *args: str) -> tuple[int, str, float]:
    """`python -m megagrpo train --nproc 2 ...` (so a passing preflight would start torchrun).
    Returns (rc, output, CPU seconds of the command: wall time on a shared 2-core machine
    says more about the neighbours than about the command)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = run_cli("train", "--nproc", "2", *args, f"run.out_dir={tmp_path / 'out'}", timeout=300,
                cwd=tmp_path)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return p.returncode, p.stdout + p.stderr, cpu


def test_cli_fails_fast_with_the_field_named(tmp_path, spm_model):
    (tmp_path / "tab.yaml").write_text(f"base: {DEMO}\nrun:\n\tsteps: 3\n")
    long_prompts = _jsonl(tmp_path / "long.jsonl", [{"prompt": "1" * 40, "answer": "1"}] * 4)
    file_task = ["data.task=file", "cold_start.steps=0", f"data.path={long_prompts}",
                 f"data.tokenizer={spm_model}",
                 "rollout.max_model_len=32", "reward.terms=[{name: exact_match}]"]
    cases = [
        (["--config", str(tmp_path / "tab.yaml")], r"tab.yaml:3:1: tabs are not allowed in YAML"),
        (["--config", DEMO, "rollout.n=4"], "rollout.n is no longer a setting"),
        (["--config", DEMO, "reward.terms=[{name: 'my_missing_rewards:score'}]"],
         "reward.terms[0]: reward 'my_missing_rewards:score': cannot import module"),
        (["--config", DEMO, *file_task],
         "4 of 4 training prompts are longer than rollout.max_model_len=32"),
        (["--config", DEMO, "run.init=/nonexistent/ckpt"], "run.init='/nonexistent/ckpt'"),
    ]
    for args, message in cases:
        rc, out, cpu_seconds = _train(tmp_path, *args)
        last = out.strip().splitlines()[-1]
        assert rc == 2, out[-3000:]
        assert last.startswith("megagrpo train: error: ") and message in last, out[-3000:]
        assert "Traceback" not in out and "vLLM" not in out, out[-3000:]
        assert not (tmp_path / "out").exists()  # no rank ever started
        assert cpu_seconds < 20, f"{args}: {cpu_seconds:.1f} CPU s"
