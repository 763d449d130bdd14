"""Built-in tool task: arithmetic on numbers too long to compute in the head, with a calculator.

`arithmetic.tools: true` with `agent.environment: megagrpo.tasks.arithmetic_tools:
CalculatorEnvironment`. A trajectory (prompt, then model / environment / model):

    12345*67890=  <calc>12345*67890</calc>  <result>838102050</result>  838102050 </s>
    prompt        turn 1 (model)            observation (environment)   turn 2 (model)

The model copies the operands into a call, the environment answers with the exact value
(`megagrpo.agent.calculator`), the model copies it out as its answer, which the `arithmetic`
reward term scores (the last turn's text). A 5-digit product is far beyond a ~1M-parameter
model's own arithmetic; both copies are within its reach, so the tool is the way to the answer.

The task's tokenizer is the arithmetic one (characters) plus the four tags as single pieces, so
a call closes with ONE token, `</calc>`: the run stops a turn on its id (`TOOL_STOP`, in
`Task.stop_ids`), since the built-in tokenizer gives the engine no text to match stop strings.
The HF chat-template tool format (`agent.environment: tools`) needs a real tokenizer; this is
the same loop in a format a tiny model can learn.
"""
from __future__ import annotations

import re
import time

from megagrpo.agent.calculator import CalculatorError, evaluate, format_number
from megagrpo.agent.env import Environment, Observation, Turn

CALL, CALL_END, RESULT, RESULT_END = "<calc>", "</calc>", "<result>", "</result>"
SYMBOLS = (CALL, CALL_END, RESULT, RESULT_END)
"""The tags, single pieces of the task's tokenizer."""
TOOL_STOP = CALL_END
"""The piece that ends a tool-calling turn."""
ENVIRONMENT = "megagrpo.tasks.arithmetic_tools:CalculatorEnvironment"
"""agent.environment of the task."""
_WELL_FORMED = re.compile(re.escape(CALL) + r"(\d+[+*-]\d+)" + re.escape(CALL_END))


def trajectory(a: int, op: str, b: int, value: int) -> tuple[tuple[str, bool], ...]:
    """The supervised (cold start) completion of one problem: (text, trained) segments; the
    environment's segment is not trained (masked out of the loss), EOS follows the last."""
    return ((f"{CALL}{a}{op}{b}{CALL_END}", True), (f"{RESULT}{value}{RESULT_END}", False),
            (str(value), True))


def parse_call(text: str) -> str | None:
    """The expression of a well-formed call (the whole turn is `<calc>A op B</calc>`), else
    None."""
    match = _WELL_FORMED.fullmatch(text.strip())
    return match.group(1) if match else None


class CalculatorEnvironment(Environment):
    """Answers a turn that ends in `</calc>` with `<result>value</result>` (an empty result
    when the call is malformed: anything but `<calc>A op B</calc>` with integers A, B, counted
    as a tool error); any other turn is the final answer (done)."""

    def step(self, turn: Turn) -> Observation:
        if not turn.text.rstrip().endswith(CALL_END):
            return Observation(done=True)
        t0 = time.perf_counter()
        expr = parse_call(turn.text)
        try:
            value = format_number(evaluate(expr)) if expr is not None else None
        except (CalculatorError, ZeroDivisionError):
            value = None
        return Observation(text=f"{RESULT}{value or ''}{RESULT_END}", tool_calls=1,
                           tool_errors=int(value is None),
                           tool_seconds=time.perf_counter() - t0)


def check_tool_task(cfg) -> None:
    """arithmetic.tools=true (the built-in calculator task) runs with its environment."""
    if cfg.data.task == "arithmetic" and cfg.arithmetic.tools \
            and cfg.agent.environment != ENVIRONMENT:
        raise ValueError(f"arithmetic.tools=true needs agent.environment={ENVIRONMENT} (the "
                         "model calls the calculator between turns); it is "
                         f"{cfg.agent.environment!r}")
