"""The built-in tool task (arithmetic.tools, megagrpo.tasks.arithmetic_tools): the calculator
environment's answers against Python ints, the cold start's trajectories well-formed and
tokenized as the rollout tokenizes them, the supervised loss of a multi-turn trajectory against
a float64 NLL over the model's tokens only, the recipe's checks before compute, and (heavy) a
short run of examples/tools-demo.yaml through the command line."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from megagrpo.agent.env import Turn
from megagrpo.algo import LossCounts
from megagrpo.config.agent import AgentConfig
from megagrpo.config.data import ArithmeticConfig, DataConfig
from megagrpo.config.train import load_config
from megagrpo.parallel.batch import sft_batch
from megagrpo.preflight import preflight
from megagrpo.tasks import arithmetic, build_task
from megagrpo.tasks.arithmetic_tools import (
    CALL_END,
    ENVIRONMENT,
    CalculatorEnvironment,
    parse_call,
)
from megagrpo.train.cold_start import encode_completion
from megagrpo.train.losses import LossContext, sft_loss
from tests.support.cli import run_cli
from tests.test_agent_tools import tokenizer  # noqa: F401 - the Hermes-style tool tokenizer

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "tools-demo.yaml"


@pytest.fixture(scope="module")
def tool_task(tmp_path_factory):
    arith = ArithmeticConfig(digits=5, operators="+*", tools=True, num_eval=20, num_train=50,
                             tokenizer_dir=str(tmp_path_factory.mktemp("tok")))
    return arith, build_task(DataConfig(), arith)


def turn(text: str, index: int = 0) -> Turn:
    return Turn(index=index, text=text, token_ids=(), finish_reason="stop")


def test_environment_answers_exactly():
    env = CalculatorEnvironment({})
    rng = random.Random(0)
    for _ in range(200):
        a, b = rng.randrange(10**rng.randint(1, 9)), rng.randrange(10**rng.randint(1, 9))
        op = rng.choice("+-*")
        want = {"+": a + b, "-": a - b, "*": a * b}[op]  # Python ints
        obs = env.step(turn(f"<calc>{a}{op}{b}</calc>"))
        assert obs.text == f"<result>{want}</result>" and not obs.done
        assert (obs.tool_calls, obs.tool_errors) == (1, 0)
    for bad in ("<calc>12*</calc>", "<calc>1+2+3</calc>", "12*3</calc>", "<calc>(1)*2</calc>",
                "<calc>1*2</calc><calc>3*4</calc>", "<calc>1/2</calc>", "</calc>"):
        obs = env.step(turn(bad))
        assert obs.text == "<result></result>" and (obs.tool_calls, obs.tool_errors) == (1, 1)
        assert not obs.done
    for answer in ("838102050", "<calc>12*3", "", "1*2</calc>5"):  # no closing tag at the end
        obs = env.step(turn(answer))
        assert obs.done and obs.tool_calls == 0


def test_trajectories_well_formed(tool_task):
    arith, task = tool_task
    tok = task.tokenizer
    assert tok.vocab_size == 23 and task.stop_ids == (tok.sp.piece_to_id(CALL_END),)
    eval_prompts = {e.prompt for e in task.eval}
    pairs = arithmetic.sft_examples(64, seed=3, cfg=arith)
    for prompt, segments in pairs:
        assert prompt not in eval_prompts and prompt.endswith("=")
        (call, t1), (obs, t2), (answer, t3) = segments
        assert (t1, t2, t3) == (True, False, True)
        expr = parse_call(call)
        assert expr is not None and expr + "=" == prompt
        op = "*" if "*" in expr else "+"
        a, b = (int(x) for x in expr.split(op))
        want = a * b if op == "*" else a + b
        assert answer == str(want) == arithmetic.answer_text(want, arith)
        # the environment reproduces the supervised observation, and the call ends with the
        # one token the rollout stops a turn on
        assert CalculatorEnvironment({}).step(turn(call)).text == obs
        ids, mask = encode_completion(tok, segments, tok.eos_id)
        n1, n2 = len(tok.encode(call)), len(tok.encode(obs))
        assert ids[n1 - 1] == task.stop_ids[0] and tok.decode(ids) == call + obs + answer
        assert mask == [True] * n1 + [False] * n2 + [True] * (len(ids) - n1 - n2)
        assert n1 == len(call) - len("<calc></calc>") + 2  # the tags are one piece each


def test_sft_loss_skips_environment_tokens(tool_task):
    """sft_loss on a batch of trajectories == float64 mean NLL over the trained tokens; the
    environment tokens get no gradient."""
    arith, task = tool_task
    tok = task.tokenizer
    pairs = arithmetic.sft_examples(4, seed=1, cfg=arith) + [("12+3=", "15")]
    prompts = [[tok.bos_id, *tok.encode(p)] for p, _ in pairs]
    comps, masks = zip(*(encode_completion(tok, c, tok.eos_id) for _, c in pairs))
    batch = sft_batch(prompts, list(comps), pad_id=tok.pad_id, multiple=1,
                      loss_masks=list(masks))
    full = sft_batch(prompts, list(comps), pad_id=tok.pad_id)
    env = full.mask & ~batch.mask
    assert int(env.sum()) == sum(m.count(False) for m in masks if m) > 0
    N, S = batch.ids.shape
    V = tok.vocab_size
    logits = torch.randn(N, S, V, generator=torch.Generator().manual_seed(0))
    x = logits.clone().requires_grad_(True)
    ctx = LossContext(tp_group=None, valid_local_vocab=V, temperature=1.0, impl="torch",
                      counts=LossCounts(num_tokens=float(batch.mask.sum()),
                                        num_seqs=float(N)))
    loss, out = sft_loss(ctx, batch, x)
    loss.backward()
    ref = logits.double().requires_grad_(True)
    nll = -torch.log_softmax(ref, -1).gather(-1, batch.target[..., None]).squeeze(-1)
    trained = torch.zeros(N, S, dtype=torch.bool)
    for r, (p, c, m) in enumerate(zip(prompts, comps, masks)):  # from the segments, not pack
        trained[r, len(p) - 1:len(p) - 1 + len(c)] = torch.tensor(m or [True] * len(c))
    want = (nll * trained.double()).sum() / trained.sum()
    want.backward()
    assert torch.equal(trained, batch.mask)
    assert abs(float(loss) - float(want)) <= 1e-6 * float(want)
    assert torch.allclose(x.grad.double(), ref.grad, atol=1e-7)
    assert (x.grad[env] == 0).all() and float(out["tokens"]) == float(trained.sum())


def test_recipe_checks_before_compute(tmp_path):
    out = f"run.out_dir={tmp_path / 'run'}"
    tok = f"arithmetic.tokenizer_dir={tmp_path / 'tok'}"
    ok = preflight(load_config(str(RECIPE), [out, tok]), 2)
    assert ok.task.stop_ids and ok.longest_prompt == 13  # BOS + 'ddddd*ddddd='
    with pytest.raises(ValueError, match=f"arithmetic.tools=true needs agent.environment="
                                         f"{ENVIRONMENT}"):
        preflight(load_config(str(RECIPE), [out, tok, "agent.environment=''"]), 2)
    with pytest.raises(ValueError, match="arithmetic.tools=true with arithmetic.reverse_answer"):
        preflight(load_config(str(RECIPE), [out, tok, "arithmetic.reverse_answer=true"]), 2)
    with pytest.raises(ValueError, match="model.vocab_size=19 is smaller .* 23"):
        preflight(load_config(str(RECIPE), [out, tok, "model.vocab_size=19"]), 2)


def test_tools_environment_through_the_one_resolver(tmp_path):
    """The runner's factory is registry.load_environment: a module:Class gets its record, and
    'tools' on a tokenizer without a chat template fails in the preflight naming the field."""
    from megagrpo.agent.registry import EnvironmentFactory
    from megagrpo.agent.runner import environment_factory

    factory = environment_factory(AgentConfig(environment=ENVIRONMENT), None)
    assert isinstance(factory, EnvironmentFactory)
    assert isinstance(factory({"a": 1}), CalculatorEnvironment)
    cfg = load_config(str(RECIPE), [f"run.out_dir={tmp_path / 'run'}", "arithmetic.tools=false",
                                    f"arithmetic.tokenizer_dir={tmp_path / 'tok'}",
                                    "agent.environment=tools", "agent.tools=[calculator]"])
    with pytest.raises(ValueError, match="agent.environment=tools needs a Hugging Face "
                                         "tokenizer with a chat template"):
        preflight(cfg, 2)


def test_tools_environment_prompts_carry_the_tool_list(tmp_path, tokenizer):  # noqa: F811
    """agent.environment=tools through the preflight: the prompts are the chat template's with
    the tools' schemas (what the model must see to call them), the records kept."""
    tokenizer.save_pretrained(tmp_path / "tok")
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"q": f"What is {k}*7?", "a": str(7 * k)}) + "\n"
                            for k in range(3)))
    overrides = [
        "data.task=file", f"data.path={path}", f"data.tokenizer={tmp_path / 'tok'}",
        "data.prompt_field=q", "data.answer_field=a",
        "data.batch_size=2", "model.vocab_size=512", "model.max_position_embeddings=1024",
        "rollout.max_model_len=1024", "agent.environment=tools", "agent.tools=[calculator]",
        "reward.terms=[{name: exact_match}]", f"run.out_dir={tmp_path / 'out'}"]
    ok = preflight(load_config(None, [*overrides, "data.template=chat"]))
    for k, e in enumerate(ok.task.train):
        assert '"name": "calculator"' in e.prompt and e.prompt.endswith(
            f"What is {k}*7?<|im_end|>\n<|im_start|>assistant\n")
        assert e.record == {"q": f"What is {k}*7?", "a": str(7 * k)}
    with pytest.raises(ValueError, match="agent.environment=tools renders the tool list through "
                                         "the chat template: set data.template=chat"):
        preflight(load_config(None, [*overrides, "data.template='{prompt}'"]))


@pytest.mark.heavy
def test_tools_demo_runs(tmp_path):
    """Two ranks, vLLM, a 30-step cold start and 2 GRPO steps of the recipe: the trajectories
    are multi-turn with calls, the environment's tokens are counted, the summary is written."""
    r = run_cli("demo", "--config", str(RECIPE), f"run.out_dir={tmp_path / 'run'}",
                f"arithmetic.tokenizer_dir={tmp_path / 'tok'}", "run.steps=2",
                "cold_start.steps=30", "cold_start.target_accuracy=0", "eval.every=0",
                "arithmetic.num_eval=16", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    steps = [s for s in steps if "reward_mean" in s]
    assert len(steps) == 2
    for s in steps:
        assert s["turns"] > 1 and s["tool_calls"] > 0 and 0 < s["env_token_share"] < 1
        assert s["logp_gap_vllm_mean"] < 1e-5
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["sft_steps"] == 30 and "eval_accuracy_after" in summary


def test_agentic_doc_tool_demo_table_is_generated():
    """docs/agentic.md's tool-demo figures are benchmarks/tools_demo_report.py's table of the kept
    run (benchmarks/results/tools_demo_cpu), none typed by hand."""
    import importlib.util

    from tests.support.docs import assert_generated_table

    spec = importlib.util.spec_from_file_location(
        "tools_demo_report", ROOT / "benchmarks" / "tools_demo_report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    assert_generated_table(ROOT / "docs" / "agentic.md", "<!-- tools-demo:start",
                           "<!-- tools-demo:end", report.table())
