"""`convert --from-megatron ... --to-hf` writes a complete HF folder: bos/eos/pad ids in
config.json, a generation_config.json (the source's when it had one), the tokenizer files with
the chat template; it accepts a training checkpoint's step directory or a run directory; a
checkpoint without a tokenizer snapshot says what is missing and takes --tokenizer."""
import json

import pytest
import torch

from megagrpo.checkpoint import MODEL_JSON
from megagrpo.hf.export import finish_hf_export, resolve_megatron_dir, save_tokenizer
from megagrpo.runtime.run_dir import TRAINER_STATE, write_manifest
from tests.support.cli import run_cli
from tests.support.tiny import load_dir, tiny_llama

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% endif %}")


def _word_tokenizer(path):
    """A word-level HF tokenizer (pad 0, bos 1, eos 2) with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>", "user", "assistant", ":", "w"]
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>", pad_token="<pad>")
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return tok


@pytest.fixture(scope="module")
def step_export(tmp_path_factory):
    """HF (weights + tokenizer + generation config) -> a checkpoint laid out as a training
    run's step directory -> HF, through the CLI."""
    root = tmp_path_factory.mktemp("export")
    tiny_llama(root / "hf", vocab=100)
    _word_tokenizer(root / "hf")
    (root / "hf" / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.7, "do_sample": True, "eos_token_id": 2}))
    step = root / "run" / "checkpoints" / "step_000003"
    p = run_cli("convert", "--from-hf", str(root / "hf"), "--to-megatron", str(step / "policy"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "tokenizer of" in p.stdout
    p = run_cli("convert", "--from-megatron", str(step), "--to-hf", str(root / "out"))
    assert p.returncode == 0, p.stderr[-3000:]
    return root, p.stdout


def test_export_from_step_dir_is_complete(step_export):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    root, stdout = step_export
    out = root / "out"
    src = AutoTokenizer.from_pretrained(root / "hf")
    cfg = json.loads((out / "config.json").read_text())
    ids = {"bos_token_id": src.bos_token_id, "eos_token_id": src.eos_token_id,
           "pad_token_id": src.pad_token_id}
    assert {k: cfg[k] for k in ids} == ids == {"bos_token_id": 1, "eos_token_id": 2,
                                               "pad_token_id": 0}
    gen = GenerationConfig.from_pretrained(out)
    assert (gen.temperature, gen.do_sample, gen.eos_token_id) == (0.7, True, 2)  # the source's
    assert (gen.bos_token_id, gen.pad_token_id) == (1, 0)  # filled in from the tokenizer
    tok = AutoTokenizer.from_pretrained(out)
    msgs = [{"role": "user", "content": "w w"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        src.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.generation_config.eos_token_id == 2
    hf, got = load_dir(root / "hf"), load_dir(out)
    assert sorted(hf) == sorted(got) and all(torch.equal(hf[k], got[k]) for k in hf)
    assert "hf tokenizer" in stdout and "eos=2" in stdout


def test_export_without_snapshot_says_so_and_takes_tokenizer(step_export, tmp_path):
    root, _ = step_export
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"bos_token_id": None, "eos_token_id": None}))
    old = tmp_path / "old_ckpt"  # a checkpoint written before snapshots existed
    old.mkdir()
    line = finish_hf_export(out, old)
    assert "no tokenizer snapshot" in line and "--tokenizer" in line
    assert json.loads((out / "config.json").read_text())["eos_token_id"] is None
    line = finish_hf_export(out, old, tokenizer=str(root / "hf"))
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 0)
    assert (out / "tokenizer.json").exists() and (out / "generation_config.json").exists()
    assert not (out / ".tokenizer-snapshot").exists()


def test_sentencepiece_snapshot(tmp_path):
    from megagrpo.data import SentencePieceTokenizer
    from megagrpo.tasks.arithmetic import build_tokenizer

    sp = build_tokenizer(tmp_path / "spm")
    save_tokenizer(tmp_path / "ckpt", sp)
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    assert "sentencepiece tokenizer (1 files)" in finish_hf_export(out, tmp_path / "ckpt")
    again = SentencePieceTokenizer(out / "tokenizer.model")
    assert again.encode("12+7=") == sp.encode("12+7=")
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["eos_token_id"], cfg["pad_token_id"]) == (sp.eos_id, sp.pad_id)


def _fake_step(root, step, *, complete):
    d = root / "checkpoints" / f"step_{step:06d}"
    (d / "policy").mkdir(parents=True)
    (d / "policy" / MODEL_JSON).write_text("{}")
    (d / TRAINER_STATE).write_text(json.dumps({"step": step}))
    if complete:
        write_manifest(d)
    return d


def test_resolve_step_dir_run_dir_and_errors(tmp_path):
    good = _fake_step(tmp_path, 2, complete=True)
    _fake_step(tmp_path, 4, complete=False)  # a save a crash interrupted
    assert resolve_megatron_dir(good) == good / "policy"
    assert resolve_megatron_dir(good / "policy") == good / "policy"
    assert resolve_megatron_dir(tmp_path) == good / "policy"  # newest intact, not step 4
    (good / TRAINER_STATE).write_text("{damaged")
    with pytest.raises(ValueError, match="damaged"):
        resolve_megatron_dir(good)
    with pytest.raises(ValueError, match="without an intact checkpoint"):
        resolve_megatron_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a megagrpo checkpoint"):
        resolve_megatron_dir(tmp_path / "checkpoints")
