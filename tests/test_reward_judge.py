"""The `judge` source with a fake engine that answers what the test scripts (no vLLM): the judge
prompt rendered through the run's chat template as a hand-written string, greedy settings, the
score parsed by the recipe's pattern, parse failures counted and dropped (or stopping the step),
the frozen base judging through the same engine with the adapter off, and refusals naming the
field."""
from __future__ import annotations

import pytest
import torch

from megagrpo.config.data import RewardConfig
from megagrpo.data import load_tokenizer
from megagrpo.engine import Completion
from megagrpo.reward import RewardContext, Sample, build_rewards, check_source
from tests.support.tiny import tiny_char_tokenizer

TEMPLATE = "Q: {prompt}\nA: {completion}\nRef: {answer}\nRate 0-10."


class JudgeEngine:
    """Answers each prompt with the next scripted text; records the calls."""

    def __init__(self, answers: list[str], max_lora_rank: int = 0) -> None:
        self.answers, self.max_lora_rank = list(answers), max_lora_rank
        self.calls: list[tuple[list[list[int]], object, dict]] = []

    def generate(self, prompts, sampling, **kwargs):
        self.calls.append((prompts, sampling, kwargs))
        return [Completion(prompt_index=i, sample_index=0, token_ids=[5], logprobs=[0.0],
                           finish_reason="stop", text=self.answers.pop(0))
                for i in range(len(prompts))]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("judge_tok")
    tiny_char_tokenizer(path)
    return load_tokenizer(str(path))


def samples() -> list[Sample]:
    return [Sample(prompt="<t>2+3", prompt_ids=[1], completion=c, completion_ids=[2],
                   answer="5", record={"question": "2+3"}) for c in ("5", "6", "five")]


def judge(tok, engine, **options) -> RewardConfig:
    cfg = RewardConfig(source="judge", options=dict(template=TEMPLATE, prompt_field="question",
                                                    scale=0.1, **options))
    cfg.validate()
    check_source(cfg)
    return cfg


def build(tok, engine, **options):
    return build_rewards(judge(tok, engine, **options),
                         context=RewardContext(engine=engine, tokenizer=tok, stop_ids=(3,)))


def test_prompt_template_parse_and_greedy(tok):
    engine = JudgeEngine(["Good. Score: 10", "Score: 3.5 because", "Score:7 Score: 2"])
    scores = build(tok, engine, system_prompt="Be strict.").score(samples())
    (prompts, sampling, kwargs), = engine.calls
    want = ("<|im_start|>system\nBe strict.<|im_end|>\n<|im_start|>user\nQ: 2+3\nA: 6\nRef: 5\n"
            "Rate 0-10.<|im_end|>\n<|im_start|>assistant\n")
    assert prompts[1] == tok.encode(want)  # the chat template, as written by hand
    assert (sampling.temperature, sampling.n, sampling.stop_token_ids) == (0.0, 1, (3,))
    assert kwargs == {}  # the policy's weights (no base_model)
    torch.testing.assert_close(scores.rewards, torch.tensor([1.0, 0.35, 0.7]))
    assert scores.correct.tolist() == [True, False, False] and scores.valid is None
    assert scores.metrics["judge_parse_failures"] == 0


def test_parse_failures_are_counted_and_dropped_not_zero(tok, caplog):
    engine = JudgeEngine(["Score: 8", "I cannot rate this.", "Score: ten"])
    with caplog.at_level("WARNING", logger="megagrpo"):
        scores = build(tok, engine).score(samples())
    assert scores.valid.tolist() == [True, False, False]
    assert scores.metrics["judge_parse_failures"] == 2
    assert scores.metrics["reward/judge"] == pytest.approx(0.8)  # over the parsed one only
    assert "2 of 3 samples unscored: 2 answers did not match" in caplog.text
    with pytest.raises(RuntimeError, match="on_failure=error stops the run"):
        build(tok, JudgeEngine(["no"] * 3), on_failure="error").score(samples())


def test_base_model_judges_with_the_adapter_off(tok):
    engine = JudgeEngine(["Score: 1"] * 3, max_lora_rank=8)
    build(tok, engine, base_model=True).score(samples())
    assert engine.calls[0][2] == {"adapter": False}
    with pytest.raises(ValueError, match="base_model=true needs vLLM serving the policy's LoRA"):
        build(tok, JudgeEngine([], max_lora_rank=0), base_model=True)
    with pytest.raises(ValueError, match="rollout.tensor_parallel_size=2"):
        build_rewards(judge(tok, None), context=RewardContext(engine=JudgeEngine([]),
                                                              tokenizer=tok, engine_tp=2))


def test_bad_options_are_refused_naming_the_field():
    cases = [({}, r"reward.options.template is required"),
             ({"template": "rate {prompt}"}, r"reward.options.template=.*put \{completion\}"),
             ({"template": "{completion} {x}"}, r"reward.options.template: a slot other than"),
             ({"template": "{completion}", "pattern": "Score: \\d+"},
              r"reward.options.pattern=.*needs a group"),
             ({"template": "{completion}", "pattern": "("}, r"not a regular expression"),
             ({"template": "{completion}", "on_failure": "zero"}, r"on_failure='zero'")]
    for options, msg in cases:
        with pytest.raises(ValueError, match=msg):
            check_source(RewardConfig(source="judge", options=options))


def test_the_preflight_checks_the_judge_against_the_recipe():
    from megagrpo.reward.judge import check_with_run

    one = RewardConfig(source="judge", options={"template": "{completion}", "base_model": True})
    with pytest.raises(ValueError, match=r"reward.options\) with rollout.tensor_parallel_size=2"):
        check_with_run(one, engine_tp=2, lora_enabled=True, lora_refit="auto")
    with pytest.raises(ValueError, match=r"reward.options.base_model=true needs vLLM serving"):
        check_with_run(one, engine_tp=1, lora_enabled=False, lora_refit="auto")
    listed = RewardConfig(sources=[{"source": "rules"}, {"source": "judge", "options": {
        "template": "{completion}", "base_model": True}}])
    with pytest.raises(ValueError, match=r"reward.sources\[1\].options.base_model=true"):
        check_with_run(listed, engine_tp=1, lora_enabled=True, lora_refit="merged")
    check_with_run(listed, engine_tp=1, lora_enabled=True, lora_refit="adapter")  # passes


def test_a_judge_prompt_too_long_for_the_engine_is_not_sent_but_counted(tok):
    """rollout.max_model_len leaves room for 'five' (3 characters longer) only without the
    judge's answer: that sample is not sent (vLLM would refuse it) and counts as too long."""
    engine = JudgeEngine(["Score: 3", "Score: 4"])
    cfg = judge(tok, engine, max_tokens=8)
    probe = build_rewards(cfg, context=RewardContext(engine=JudgeEngine([]), tokenizer=tok))
    short = len(probe.source.judge_prompt(samples()[0]))
    context = RewardContext(engine=engine, tokenizer=tok, max_model_len=short + 8 + 1)
    scores = build_rewards(cfg, context=context).score(samples())
    (prompts, _, _), = engine.calls
    assert len(prompts) == 2  # "5" and "6"
    torch.testing.assert_close(scores.rewards[:2], torch.tensor([0.3, 0.4]))
    assert scores.valid.tolist() == [True, True, False]
    assert scores.metrics["judge_too_long"] == 1 and scores.metrics["judge_parse_failures"] == 0


def test_agreement_with_the_correctness_source_is_counted(tok):
    """rules (exact match, the correctness source) next to a judge: the 2x2 counts of the two
    verdicts over the samples both scored, against the counts taken by hand from each source's
    own verdicts; a parse failure is in no cell."""
    cfg = RewardConfig(terms=[{"name": "exact_match"}], sources=[
        {"source": "rules", "weight": 1.0, "correctness": True},
        {"source": "judge", "weight": 0.0, "options": dict(
            template=TEMPLATE, prompt_field="question", scale=0.1, correct_at=0.5)}])
    cfg.validate()
    check_source(cfg)
    s = samples() + [Sample(prompt="<t>1+1", prompt_ids=[1], completion=c, completion_ids=[2],
                            answer="2", record={"question": "1+1"}) for c in ("2", "3", "2")]
    # exact match: 5 yes, 6 no, five no, 2 yes, 3 no, 2 yes
    engine = JudgeEngine(["Score: 9", "Score: 8", "Score: 1", "Score: 7", "Score: 0", "??"])
    scores = build_rewards(cfg, context=RewardContext(engine=engine, tokenizer=tok,
                                                      stop_ids=(3,))).score(s)
    rule = [1, 0, 0, 1, 0, 1]
    judged = [1, 1, 0, 1, 0, None]  # >= 0.5 after scale 0.1; the last did not parse
    cells = {"both": 0, "head_only": 0, "source_only": 0, "neither": 0}
    for r, j in zip(rule, judged, strict=True):
        if j is not None:
            cells[{(1, 1): "both", (1, 0): "head_only", (0, 1): "source_only",
                   (0, 0): "neither"}[(r, j)]] += 1
    assert {k: scores.metrics[f"agreement/judge/{k}"] for k in cells} == cells
    assert not any(k.startswith("agreement/rules") for k in scores.metrics)
    assert scores.correct.tolist() == [bool(r) for r in rule]  # still the rules' verdict
    # the judge at weight 0 only watches: its parse failure leaves the sample in the loss
    assert scores.valid is None and scores.metrics["judge_parse_failures"] == 1
