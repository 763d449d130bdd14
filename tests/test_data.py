"""Prompt files, templates, tokenizers behind one protocol, and the DP-sharded loader."""
import json
import sys

import pytest

from megagrpo import data
from megagrpo.config.data import DataConfig
from megagrpo.data import Example, PromptLoader


def _write_jsonl(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    return path


def test_jsonl_nested_fields_and_template(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [
        {"q": {"text": "1+1?"}, "sol": 2}, {"q": {"text": "2+3?"}, "sol": "5"}])
    records = data.read_records(path)
    got = data.build_examples(records, prompt_field="q.text", answer_field="sol",
                              template="Q: {prompt}\nA:")
    assert got == [Example(prompt="Q: 1+1?\nA:", answer="2"),
                   Example(prompt="Q: 2+3?\nA:", answer="5")]
    with pytest.raises(KeyError, match=r"available: \['q', 'sol'\]"):
        data.build_examples(records, prompt_field="question")


def test_json_array_and_bad_lines(tmp_path):
    arr = tmp_path / "a.json"
    arr.write_text(json.dumps([{"prompt": "x", "answer": 1}]))
    assert data.read_records(arr) == [{"prompt": "x", "answer": 1}]
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"prompt": "x"}\n{oops\n')
    with pytest.raises(ValueError, match="b.jsonl:2"):
        data.read_records(bad)
    with pytest.raises(FileNotFoundError):
        data.read_records(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="data.format"):
        data.read_records(arr.rename(tmp_path / "a.txt"))


def test_parquet_records(tmp_path):
    # pyarrow is in requirements-cpu.txt: a missing or broken install fails here, never skips
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", "2"]}), path)
    want = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]
    assert data.read_records(path) == want


def test_parquet_without_pyarrow_is_a_clear_error(tmp_path, monkeypatch):
    # None in sys.modules makes `import pyarrow.parquet` raise ImportError, as when absent
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    path = tmp_path / "p.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(ImportError, match="pip install pyarrow"):
        data.read_records(path)


def test_datasets_folder_without_the_package_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    folder = tmp_path / "ds"
    folder.mkdir()
    with pytest.raises(ImportError, match="pip install datasets"):
        data.read_records(folder)


@pytest.mark.heavy  # `datasets` (pandas, xxhash, multiprocess, ...) is not in requirements-cpu.txt
def test_datasets_folder_records(tmp_path):
    try:
        import datasets
    except ImportError:
        pytest.fail("this heavy test reads a real datasets folder: `.venv/bin/python -m pip "
                    "install datasets` first (it is not in requirements-cpu.txt)")
    folder = tmp_path / "ds"
    train = datasets.Dataset.from_dict({"prompt": ["a"], "answer": ["1"]})
    dd = datasets.DatasetDict({"train": train})
    dd.save_to_disk(str(folder))
    assert data.read_records(folder, split="train") == [{"prompt": "a", "answer": "1"}]
    with pytest.raises(ValueError, match="has splits"):
        data.read_records(folder, split="test")


def test_sentencepiece_tokenizer_protocol(tmp_path):
    import sentencepiece as spm
    text = ["the cat sat on the mat", "a dog ate the hat", "cats and dogs"] * 20
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text), model_prefix=str(tmp_path / "sp"), vocab_size=30,
        model_type="bpe", bos_id=1, eos_id=2, pad_id=-1, unk_id=0, minloglevel=2)
    tok = data.load_tokenizer(str(tmp_path / "sp.model"))
    assert isinstance(tok, data.Tokenizer)
    assert (tok.eos_id, tok.pad_id, tok.bos_id, tok.vocab_size) == (2, 2, 1, 30)
    with pytest.raises(FileNotFoundError):
        data.load_tokenizer(str(tmp_path / "missing.model"))
    ids = data.encode_prompt(tok, "the cat")
    assert ids[0] == 1 and tok.decode(ids) == "the cat"
    assert tok.decode([*ids, 2, 30, 127]) == "the cat"  # EOS and TP-padding ids vanish


def test_hf_tokenizer_chat_template(tmp_path):
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = ["<pad>", "<s>", "</s>", "<unk>", "hi", "sum", "system", "user", "assistant", ":"]
    raw = RawTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>"
                          "{% endfor %}{% if add_generation_prompt %}<s>assistant:{% endif %}")
    fast.save_pretrained(tmp_path)
    tok = data.load_tokenizer(str(tmp_path))
    assert isinstance(tok, data.Tokenizer)
    assert (tok.eos_id, tok.pad_id, tok.bos_id) == (2, 2, 1)  # no pad token: falls back to EOS
    text = data.format_prompt("sum", "chat", tok, system_prompt="hi")
    assert text == "<s>system: hi</s><s>user: sum</s><s>assistant:"
    ids = data.encode_prompt(tok, text)
    assert ids[:2] == [1, 6] and ids.count(1) == 3  # BOS from the template, not doubled
    assert tok.decode([4, 2, 99]) == "hi"
    with pytest.raises(ValueError, match="chat"):
        data.format_prompt("sum", "chat", None)


def _examples(n):
    return [Example(prompt=f"p{i}", answer=str(i)) for i in range(n)]


def test_loader_epochs_cover_dataset_once_and_reshuffle():
    loader = PromptLoader(_examples(10), batch_size=4, seed=3)
    assert len(loader) == 2  # 2 leftovers dropped each epoch
    epochs = {}
    for _ in range(6):
        batch = next(loader)
        epochs.setdefault(loader.epoch, []).extend(int(e.answer) for e in batch)
    assert sorted(epochs) == [0, 1, 2]
    for ids in epochs.values():
        assert len(ids) == 8 and len(set(ids)) == 8
    assert epochs[0] != epochs[1]


def test_loader_dp_shards_partition_the_global_batch():
    full = PromptLoader(_examples(24), batch_size=6, seed=1)
    ranks = [PromptLoader(_examples(24), batch_size=6, dp_rank=r, dp_size=3, seed=1)
             for r in range(3)]
    for _ in range(5):  # crosses an epoch boundary
        want = next(full)
        got = [e for r in ranks for e in next(r)]
        assert got == want
        assert all(r.epoch == full.epoch for r in ranks)


def test_loader_resume_continues_exactly_even_at_another_dp_size():
    ref = PromptLoader(_examples(20), batch_size=4, seed=7)
    stream = [next(ref) for _ in range(12)]
    first = PromptLoader(_examples(20), batch_size=4, seed=7)
    for _ in range(7):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))  # survives serialisation
    resumed = [PromptLoader(_examples(20), batch_size=4, dp_rank=r, dp_size=2, seed=7)
               for r in range(2)]
    for loader in resumed:
        loader.load_state_dict(state)
    for step in range(7, 12):
        assert next(resumed[0]) + next(resumed[1]) == stream[step]
    assert resumed[0].epoch == ref.epoch == 2
    with pytest.raises(ValueError, match="seed"):
        PromptLoader(_examples(20), batch_size=4, seed=8).load_state_dict(state)


def test_loader_argument_errors_and_shard():
    with pytest.raises(ValueError, match="divisible"):
        PromptLoader(_examples(8), batch_size=3, dp_size=2)
    with pytest.raises(ValueError, match="one batch"):
        PromptLoader(_examples(2), batch_size=4)
    ex = _examples(7)
    shards = [data.shard(ex, r, 3) for r in range(3)]
    assert sorted((e for s in shards for e in s), key=lambda e: e.prompt) == ex


def test_data_config_validation():
    DataConfig().validate()
    for kw, field in [({"task": "x"}, "data.task"), ({"format": "csv"}, "data.format"),
                      ({"task": "file"}, "data.path"), ({"template": "no slot"}, "data.template"),
                      ({"batch_size": 0}, "data.batch_size")]:
        with pytest.raises(ValueError, match=field):
            DataConfig(**kw).validate()
