"""The built-in tool-calling environment (`agent.environment: tools`).

Each assistant turn is parsed for `<tool_call>` JSON (megagrpo.agent.toolcall); no call ends the
trajectory. Otherwise every call runs (megagrpo.agent.tools) and the observation is the text the
model's chat template puts after the assistant turn: the rest of the assistant turn's closing
that the model did not sample itself (e.g. the newline after `<|im_end|>`), the tool turn(s)
with the results, and the start of the next assistant turn (the generation prompt). It is
obtained from the template itself: the conversation [user, assistant, tool...] is rendered with
`apply_chat_template(tools=..., add_generation_prompt=True)` and the text after the assistant's
content is taken, so the observation is exactly what the template produces, whatever its
format. The assistant's content is a placeholder in that rendering: the trajectory keeps the
sampled ids as they are (token in, token out); only the template's text after them is used.

Every string a model or a tool wrote (a result, a tool name, an unknown name the model made up)
is defused before it reaches the template (`defuse`), and the encoded observation is checked to
hold exactly the control tokens the template writes around placeholder results (`controls`):
an observation with any other is replaced by error results (`safe_observation`), so no tool
output can forge a turn, whatever the tokenizer's special tokens.

`check_tool_template` runs before compute: a tokenizer without a chat template, or a template
that ignores `tools=` or role 'tool' messages, is a ValueError naming agent.environment.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from megagrpo.agent.env import Environment, Observation, Turn
from megagrpo.agent.toolcall import ToolCall, parse_tool_calls
from megagrpo.agent.tools import Tool, ToolResult

FIELD = "agent.environment"
_QUESTION = "\ue000megagrpo-question\ue001"
_ASSISTANT = "\ue000megagrpo-assistant\ue001"
_RESULT = "\ue000megagrpo-result\ue001"
"""Placeholders (private-use characters) the template renders verbatim, found again in its
output."""
TAIL_TOKENS = 32
"""How many of a turn's last ids are decoded (with special tokens) to see how much of the
template's closing the model sampled itself."""


def hf_tokenizer(tokenizer: object) -> object:
    """The Hugging Face tokenizer inside megagrpo's `HFTokenizer` wrapper, or `tokenizer`."""
    return getattr(tokenizer, "tok", tokenizer)


def tokenizer_name(hf: object) -> str:
    """A Hugging Face tokenizer's name for messages: its folder, else its class."""
    return getattr(hf, "name_or_path", "") or type(hf).__name__


def templated_tokenizer(tokenizer: object, needs: str) -> object:
    """The Hugging Face tokenizer of `tokenizer`, which must have a chat template; ValueError
    saying what `needs` one and how to give it otherwise."""
    hf = hf_tokenizer(tokenizer)
    if not hasattr(hf, "apply_chat_template") or not getattr(hf, "chat_template", None):
        raise ValueError(f"{needs}; tokenizer {tokenizer_name(hf)!r} has none (give "
                         "data.tokenizer a model folder whose tokenizer_config.json or "
                         "chat_template.jinja has one)")
    return hf


@dataclass(frozen=True)
class ToolTemplate:
    """A tokenizer's chat template checked for tool support, with the run's tool schemas."""

    tokenizer: object
    """The Hugging Face tokenizer."""
    schemas: list[dict]
    lead: int = 0
    """Characters the template puts between an assistant turn's content and a following tool
    result (the turn's closing and the tool turn's opening): at most this much of the
    observation can be text the model sampled itself."""

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.schemas or None,
                                                  tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def observation(self, results: list[ToolResult], sampled_tail: str) -> str:
        """The template's text after an assistant turn answered by `results`, minus the part of
        the turn's closing that `sampled_tail` (the turn's last text, special tokens included)
        already ends with. Special-token strings inside a result are defused (`defuse`)."""
        messages = [{"role": "user", "content": _QUESTION},
                    {"role": "assistant", "content": _ASSISTANT},
                    *({"role": "tool", "name": defuse(self.tokenizer, r.name),
                       "content": defuse(self.tokenizer, r.text)}
                      for r in results)]
        full = self.render(messages, add_generation_prompt=True)
        after = full[full.index(_ASSISTANT) + len(_ASSISTANT):]
        return after[_overlap(sampled_tail, after, self.lead):]

    def encode(self, text: str) -> list[int]:
        """An observation's ids: its text encoded once, no special tokens added (what the
        runner would do with the text)."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def controls(self, ids: list[int]) -> list[int]:
        """The control ids in `ids` (special tokens and added-vocabulary tokens), in order."""
        return [i for i in ids if i in self.control_ids]

    @functools.cached_property
    def control_ids(self) -> frozenset[int]:
        """Ids of the tokenizer's special and added tokens."""
        ids = set(getattr(self.tokenizer, "all_special_ids", None) or [])
        ids.update(getattr(self.tokenizer, "get_added_vocab", lambda: {})().values())
        return frozenset(ids)

    def safe_observation(self, results: list[ToolResult], sampled_tail: str
                         ) -> tuple[str, list[int], bool]:
        """(text, ids, clean) of the observation. `clean` is False when the encoded results
        held control tokens the template did not write itself (a string `defuse` missed):
        then every result is replaced by an error message and the observation rebuilt."""
        text = self.observation(results, sampled_tail)
        ids = self.encode(text)
        blank = [replace(r, name="tool", text="") for r in results]
        want = self.controls(self.encode(self.observation(blank, sampled_tail)))
        if self.controls(ids) == want:
            return text, ids, True
        refused = [replace(r, name="tool", error=True, text=UNSAFE) for r in results]
        text = self.observation(refused, sampled_tail)
        return text, self.encode(text), False


UNSAFE = ("error: the tool's output held control tokens of the chat template and is not "
          "shown")


def defuse(tokenizer: object, text: str) -> str:
    """`text` with every special-token string (e.g. '<|im_end|>', '<|im_start|>') broken by a
    zero-width space after its first character. A tool's output is untrusted: code the model
    wrote can print '<|im_end|>' and '<|im_start|>assistant', which the observation's single
    tokenization would turn into real control tokens, forging turns; defused, it is plain text."""
    specials = getattr(tokenizer, "all_special_tokens", None) or []
    added = getattr(tokenizer, "get_added_vocab", lambda: {})()
    for tok in sorted({*specials, *added}, key=len, reverse=True):
        if len(tok) > 1 and tok in text:
            text = text.replace(tok, tok[0] + "\u200b" + tok[1:])
    return text


def _overlap(sampled: str, after: str, most: int) -> int:
    """Largest k <= most with sampled.endswith(after[:k])."""
    for k in range(min(most, len(sampled)), 0, -1):
        if sampled.endswith(after[:k]):
            return k
    return 0


def check_tool_template(tokenizer: object, tools: tuple[Tool, ...] | list[Tool]) -> ToolTemplate:
    """The tokenizer's chat template, checked to render the tool list (`tools=`) and role 'tool'
    messages after an assistant turn; ValueError naming agent.environment otherwise."""
    hf = templated_tokenizer(tokenizer, f"{FIELD}=tools needs a Hugging Face tokenizer with a "
                             "chat template")
    name = tokenizer_name(hf)
    template = ToolTemplate(hf, [t.schema() for t in tools])
    try:
        prompt = template.render([{"role": "user", "content": _QUESTION}], True)
        turns = template.render([{"role": "user", "content": _QUESTION},
                                 {"role": "assistant", "content": _ASSISTANT},
                                 {"role": "tool", "name": tools[0].name if tools else "tool",
                                  "content": _RESULT}], True)
    except Exception as e:  # noqa: BLE001 - jinja's TemplateError, a raise_exception(...)
        raise ValueError(f"{FIELD}=tools: the chat template of tokenizer {name!r} fails on a "
                         f"conversation with tools and a tool message ({type(e).__name__}: "
                         f"{e}); use a model whose template supports tool calling") from None
    missing = [t.name for t in tools if t.name not in prompt]
    if missing:
        raise ValueError(f"{FIELD}=tools: the chat template of tokenizer {name!r} ignores "
                         f"apply_chat_template(tools=...): the tools {missing} do not appear in "
                         "the prompt, so the model cannot know them; use a model whose template "
                         "supports tool calling (e.g. Qwen2.5/Qwen3, Hermes format)")
    if not (_ASSISTANT in turns and _RESULT in turns[turns.index(_ASSISTANT):]):
        raise ValueError(f"{FIELD}=tools: the chat template of tokenizer {name!r} does not "
                         "render role 'tool' messages after an assistant turn; use a model "
                         "whose template supports tool calling")
    start = turns.index(_ASSISTANT) + len(_ASSISTANT)
    return ToolTemplate(hf, template.schemas, turns.index(_RESULT, start) - start)


def system_tools_prompt(tokenizer: object, messages: list[dict], tools: tuple[Tool, ...]) -> str:
    """A prompt rendered with the tool list: apply_chat_template(messages, tools=[schemas],
    add_generation_prompt=True) as text."""
    return ToolTemplate(hf_tokenizer(tokenizer), [t.schema() for t in tools]).render(messages, True)


class ToolEnvironment(Environment):
    """Runs the tool calls of each assistant turn; a turn without a call ends the trajectory.

    kwargs (agent.kwargs): max_calls_per_turn (default 8: calls beyond it are answered with an
    error and counted as tool errors)."""

    def __init__(self, record: dict, tokenizer: object = None, *, tools: tuple[Tool, ...],
                 template: ToolTemplate | None = None, max_calls_per_turn: int = 8) -> None:
        super().__init__(record, tokenizer)
        self.tools = {t.name: t for t in tools}
        self.template = template or check_tool_template(tokenizer, tools)
        self.max_calls_per_turn = max_calls_per_turn

    def step(self, turn: Turn) -> Observation:
        calls = parse_tool_calls(turn.text)
        if not calls:
            return Observation(done=True)
        results = [self.run_call(call, i) for i, call in enumerate(calls)]
        text, ids, clean = self.template.safe_observation(results, self._sampled_tail(turn))
        return Observation(text=text, token_ids=tuple(ids), tool_calls=len(results),
                           tool_errors=sum(r.error for r in results) if clean else len(results),
                           tool_seconds=sum(r.seconds for r in results))

    def state_dict(self) -> dict:
        """Empty: it keeps nothing between turns (each call runs in a sandbox of its own), so
        a resume continues its paused trajectories where they were (rollout.partial_rollouts)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to put back (`state_dict`)."""

    def run_call(self, call: ToolCall, index: int) -> ToolResult:
        """The result of one parsed call (an error result for a bad call; never raises)."""
        name = call.name or "invalid"
        if call.error:
            return ToolResult(name=name, text=f"error: {call.error}", error=True, seconds=0.0)
        if index >= self.max_calls_per_turn:
            return ToolResult(name=name, error=True, seconds=0.0,
                              text=f"error: more than {self.max_calls_per_turn} tool calls in "
                                   "one turn; this one was not run")
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(name=name, error=True, seconds=0.0,
                              text=f"error: unknown tool {call.name!r}; the tools are "
                                   f"{sorted(self.tools)}")
        return tool.call(call.arguments)

    def _sampled_tail(self, turn: Turn) -> str:
        return sampled_tail(self.template.tokenizer, turn)


def sampled_tail(hf: object, turn: Turn) -> str:
    """The turn's last text with special tokens (an EOS like <|im_end|> included), decoded by
    the Hugging Face tokenizer `hf`."""
    ids = [i for i in turn.token_ids[-TAIL_TOKENS:] if 0 <= i < len(hf)]  # no TP padding
    return hf.decode(ids, skip_special_tokens=False) if ids else turn.text
