"""Tool calls in the Hermes / Qwen format, parsed from an assistant turn's text:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2**64 + 1"}}
    </tool_call>

Several calls per turn are allowed. A call whose JSON is malformed, lacks a string `name`, or
has `arguments` that are not an object (a JSON string holding an object is accepted: some
models emit one), and a `<tool_call>` left unclosed, become a `ToolCall` with `error` set: the
environment answers it with the error and counts it as a tool error.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclass(frozen=True, kw_only=True)
class ToolCall:
    """One parsed call; `error` non-empty when it could not be parsed (then `name` may be '')."""

    name: str = ""
    arguments: dict = field(default_factory=dict)
    error: str = ""
    raw: str = ""
    """The text between the tags."""


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The calls in `text`, in order; [] when it has none."""
    calls = [_parse_one(m.group(1)) for m in _CALL.finditer(text)]
    rest = _CALL.sub("", text)
    if OPEN in rest:
        tail = rest[rest.index(OPEN) + len(OPEN):]
        calls.append(ToolCall(error=f"unclosed {OPEN} (end it with {CLOSE})", raw=tail.strip()))
    return calls


def _parse_one(raw: str) -> ToolCall:
    body = raw.strip()
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall(error=f"the tool call is not valid JSON ({e.msg} at char {e.pos})",
                        raw=body)
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall(error='a tool call is a JSON object {"name": ..., "arguments": {...}}',
                        raw=body)
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(name=call["name"], error="the tool call's arguments must be a JSON object",
                        raw=body)
    return ToolCall(name=call["name"], arguments=arguments, raw=body)
