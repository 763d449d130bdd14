"""The `reward_model` source on tiny random sequence-classification checkpoints (Qwen2 and Llama
layouts, made here) against transformers' own model called one sample at a time, the chat
template rendered as a hand-written string, and several sources weighted in one recipe."""
from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from megagrpo.config.data import RewardConfig
from megagrpo.plan.reward import parameter_count
from megagrpo.reward import Sample, build_rewards, check_source, exact_match_reward
from megagrpo.reward.reward_model import RewardModelSource
from tests.support.tiny import tiny_qwen2, tiny_reward_model

QUESTIONS = ["What is 2+3?", "Name a colour.", "12*12=?"]
COMPLETIONS = ["5", "The answer is five, I think.", "red", "Blue!", "144", "one hundred and "
               "forty-four, which is 12 squared", "?"]


def samples() -> list[Sample]:
    out = []
    for i, c in enumerate(COMPLETIONS):
        q = QUESTIONS[i % len(QUESTIONS)]
        out.append(Sample(prompt=f"<templated>{q}", prompt_ids=[1], completion=c,
                          completion_ids=[2], answer="5", record={"question": q}))
    return out


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def rm_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"rm_{request.param}")
    tiny_reward_model(path, arch=request.param)
    return path


def reference(path, texts: list[str], keep: int = 0) -> list[float]:
    """transformers' model on each text alone (no padding, its own pooling); `keep` > 0: on
    the text's last `keep` tokens."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for t in texts:
            ids = tok(t, add_special_tokens=False, return_tensors="pt")["input_ids"]
            out.append(float(model(input_ids=ids[:, -keep:] if keep else ids).logits[0, 0]))
    return out


def rm_config(path, **options) -> RewardConfig:
    cfg = RewardConfig(source="reward_model", options=dict(path=str(path), **options))
    cfg.validate()
    check_source(cfg)
    return cfg


def test_batched_scores_equal_transformers_one_at_a_time(rm_dir):
    """Batches of 3 (7 samples: a short last batch), right-padded; the chat template applied
    to (record question, completion) exactly as written by hand below."""
    rewards = build_rewards(rm_config(rm_dir, batch_size=3, prompt_field="question"))
    handle = rewards.submit(samples())
    scores = handle.result()
    texts = [f"<|im_start|>user\n{QUESTIONS[i % 3]}<|im_end|>\n<|im_start|>assistant\n{c}"
             "<|im_end|>\n" for i, c in enumerate(COMPLETIONS)]
    want = torch.tensor(reference(rm_dir, texts))
    assert scores.rewards.dtype == torch.float32
    torch.testing.assert_close(scores.rewards, want, rtol=1e-5, atol=1e-5)
    assert len(set(scores.rewards.tolist())) == len(COMPLETIONS)  # the scores differ
    assert scores.metrics["reward/reward_model"] == pytest.approx(float(want.mean()), abs=1e-5)
    rewards.close()


def test_format_template_and_the_policys_prompt_text(rm_dir):
    cfg = rm_config(rm_dir, batch_size=4, prompt_field="",
                    template="Q: {prompt}\nA: {completion}")
    src = RewardModelSource(cfg)
    assert src.model is None  # a rank that never scores (not an engine's leader) holds none
    fut = src.score(samples())
    assert isinstance(fut, Future)  # scored in the source's thread
    texts = [f"Q: <templated>{QUESTIONS[i % 3]}\nA: {c}" for i, c in enumerate(COMPLETIONS)]
    torch.testing.assert_close(fut.result().rewards, torch.tensor(reference(rm_dir, texts)),
                               rtol=1e-5, atol=1e-5)
    src.close()


def test_truncation_keeps_the_last_tokens_and_is_counted(rm_dir):
    src = RewardModelSource(rm_config(rm_dir, prompt_field="", template="{prompt}{completion}",
                                      max_length=12))
    s = samples()
    scores = src.score_now(s)
    texts = [x.prompt + x.completion for x in s]
    torch.testing.assert_close(scores.rewards, torch.tensor(reference(rm_dir, texts, keep=12)),
                               rtol=1e-5, atol=1e-5)
    assert scores.metrics["reward_model_truncated"] == 7  # every sample has > 12 tokens
    with pytest.raises(ValueError, match="prompt_field='question': a data record has no"):
        RewardModelSource(rm_config(rm_dir, prompt_field="question")).score_now(
            [Sample(prompt="p", prompt_ids=[1], completion="c", completion_ids=[2], answer="")])


def test_its_memory_in_the_plan(rm_dir, capsys):
    """`megagrpo plan` counts the reward model's parameters from its safetensors headers (as
    many as transformers loads) and adds weights + one batch's activations (by hand: batch 4 x
    T 16 tokens x (hidden 64 + 2 x FFN 128 + 4 heads x T 16) values of 4 bytes) beside vLLM."""
    from transformers import AutoModelForSequenceClassification

    from megagrpo.plan import run_plan
    from tests.test_plan import TINY

    model = AutoModelForSequenceClassification.from_pretrained(rm_dir)
    n, _ = parameter_count(str(rm_dir))
    assert n == sum(p.numel() for p in model.parameters())
    opts = f"{{path: '{rm_dir}', batch_size: 4, max_length: 16}}"
    assert run_plan(None, [*TINY, "reward.source=reward_model", f"reward.options={opts}"],
                    gpus=4, gpu_mem_gib=1.0) == 0
    out = capsys.readouterr().out
    act = 4 * 16 * (64 + 2 * 128 + 4 * 16) * 4
    assert (f"reward model (reward.options.path): {n / 1e6:.1f}M params, weights "
            f"{n * 4 / 2**30:.2f} GiB (float32) + activations {act / 2**30:.2f} GiB") in out
    assert run_plan(None, [*TINY, "reward.source=reward_model", f"reward.options={opts}"],
                    gpus=4, gpu_mem_gib=n * 4 / 2**30) == 1  # the model alone fills the GPU


def test_bad_options_are_refused_naming_the_field(rm_dir, tmp_path):
    tiny_qwen2(tmp_path / "lm")
    cases = [({"path": str(tmp_path)}, r"reward.options.path=.*no config.json"),
             ({"path": str(tmp_path / "lm")}, r"holds Qwen2ForCausalLM.*ForSequenceClass"),
             ({"path": str(rm_dir), "template": "{prompt}"},
              r"reward.options.template='\{prompt\}': use 'chat' or a format string"),
             ({"path": str(rm_dir), "dtype": "fp8"}, r"reward.options.dtype='fp8'"),
             ({"path": str(rm_dir), "batchsize": 2}, r"reward.options.batchsize: unknown"),
             ({}, r"reward.options.path is required")]
    for options, msg in cases:
        with pytest.raises(ValueError, match=msg):
            check_source(RewardConfig(source="reward_model", options=options))


def test_weighted_sources_in_one_recipe(rm_dir):
    """rules (exact match) x 0.5 + reward model x 2.0: the total by hand from each source
    alone, each source's raw reward in per_term and its mean as reward/<label>, held-out
    correctness from the source marked."""
    rm_opts = {"path": str(rm_dir), "prompt_field": "question"}
    cfg = RewardConfig(terms=[{"name": "exact_match"}], sources=[
        {"source": "rules", "weight": 0.5, "correctness": True},
        {"source": "reward_model", "weight": 2.0, "options": rm_opts, "label": "rm"}])
    cfg.validate()
    check_source(cfg)
    s = samples()
    scores = build_rewards(cfg).score(s)
    em = torch.tensor([exact_match_reward(x.completion, x.answer) for x in s])
    rm = RewardModelSource(rm_config(rm_dir, prompt_field="question")).score_now(s).rewards
    assert em.tolist()[:2] == [1.0, 0.0]  # "5" against "5"
    torch.testing.assert_close(scores.rewards, 0.5 * em + 2.0 * rm)
    torch.testing.assert_close(scores.per_term["rm"], rm)
    assert torch.equal(scores.per_term["rules"], em)
    assert scores.correct.tolist() == (em >= 1).tolist()
    assert scores.metrics["reward/rm"] == pytest.approx(float(rm.mean()), abs=1e-6)
    assert scores.metrics["reward/rules"] == pytest.approx(float(em.mean()))
    bad = RewardConfig(sources=[{"source": "rules"},
                                {"source": "reward_model", "options": {"path": "/nowhere"}}])
    with pytest.raises(ValueError, match=r"reward.sources\[1\].options.path='/nowhere'"):
        check_source(bad)
    with pytest.raises(ValueError, match=r"reward.sources is set together with reward.source"):
        RewardConfig(source="remote", sources=[{"source": "rules"}]).validate()
    with pytest.raises(ValueError, match=r"reward.sources\[1\].correctness and"):
        RewardConfig(sources=[{"source": "rules", "correctness": True},
                              {"source": "rules", "correctness": True}]).validate()
