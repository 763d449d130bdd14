"""Tools the model can call: the built-ins and user functions `module:function`, each with a JSON
schema derived from its type hints and a call path that never raises.

A tool is a plain function with typed parameters and a docstring:

    def lookup(word: str, limit: int = 3) -> str:
        \"\"\"Looks a word up in the dictionary.

        Args:
            word: the word
            limit: how many senses to return
        \"\"\"

Its schema (the format `tokenizer.apply_chat_template(tools=...)` renders) comes from the hints
(int, float, str, bool, list[...], dict, Literal[...], Optional[...]); parameters with defaults
are not required; the description is the docstring's first paragraph, a parameter's
description its line in an `Args:` section. A function without a hint on any parameter, or
without a docstring, is refused at load time (before compute).

Built-ins: `calculator` (exact arithmetic, in process: megagrpo.agent.calculator) and `python`
(runs code in the sandbox). User tools are untrusted: the rank never imports them. Their module
is imported, and the schema derived (megagrpo.agent.tool_schema), in a sandboxed child at load
time, and every call runs in another (megagrpo.agent.sandbox) with the agent.tool_* limits,
which imports the module and calls the function with the JSON arguments. Whatever a tool does
(raise, loop, sleep, print 10 MB, open a socket), the caller gets a `ToolResult` with the error
text the model sees.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from megagrpo.agent.calculator import evaluate, format_number
from megagrpo.agent.sandbox import (
    Limits,
    SandboxResult,
    call_function,
    describe_function,
    run_code,
)
from megagrpo.agent.tool_schema import FIELD, function_schema
from megagrpo.runtime.names import import_failure


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression exactly: integers of any size, decimals, parentheses
    and + - * / // % ** (integer exponents); / gives an exact result (a decimal or p/q).

    Args:
        expression: the expression, e.g. (123456789 * 987654321) // 7
    """
    return format_number(evaluate(expression))


def python(code: str) -> str:
    """Runs a Python program and returns what it prints (stdout, then stderr). No network, no
    files kept between calls; print the values you need.

    Args:
        code: the program's source code
    """
    return _describe(run_code(code, Limits()), Limits())[0]


BUILTIN_TOOLS: dict[str, Callable[..., str]] = {"calculator": calculator, "python": python}


@dataclass(frozen=True, kw_only=True)
class ToolResult:
    """One tool call's outcome, as the model will see it."""

    name: str
    text: str
    error: bool
    seconds: float


@dataclass(frozen=True, kw_only=True)
class Tool:
    """A loaded tool: its schema and how to call it (`target`: 'calculator', 'python' or
    'module:function')."""

    name: str
    description: str
    parameters: dict
    """JSON schema of the arguments: {"type": "object", "properties": ..., "required": ...}."""
    target: str
    limits: Limits = field(default_factory=Limits)

    def schema(self) -> dict:
        """The tool in the function-calling format chat templates render (`tools=[...]`)."""
        return {"type": "function", "function": {"name": self.name,
                                                 "description": self.description,
                                                 "parameters": self.parameters}}

    def call(self, arguments: object) -> ToolResult:
        """Runs the tool on `arguments` (the call's JSON object); never raises."""
        start = time.monotonic()
        try:
            problem = check_arguments(arguments, self.parameters)
            if problem:
                text, error = f"error: {problem}", True
            elif self.target == "calculator":
                text, error = _calculate(arguments["expression"], self.limits)
            elif self.target == "python":
                text, error = _describe(run_code(arguments["code"], self.limits), self.limits)
            else:
                module, _, function = self.target.partition(":")
                result = call_function(module, function, arguments, self.limits)
                text, error = _describe(result, self.limits, call=True)
        except Exception as e:  # noqa: BLE001 - a tool failure is the model's observation
            text, error = f"error: {type(e).__name__}: {e}", True
        return self._result(text, error, start)

    def _result(self, text: str, error: bool, start: float) -> ToolResult:
        return ToolResult(name=self.name, text=text, error=error, seconds=time.monotonic() - start)


def load_tools(specs: list[str], limits: Limits) -> tuple[Tool, ...]:
    """The tools named in agent.tools, checked: importable, typed, documented, unique names.
    A user tool's module is imported, and its schema derived, inside the sandbox (its
    top-level code is as untrusted as the function); the rank never imports it. Raises
    ValueError naming agent.tools otherwise."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        if spec in BUILTIN_TOOLS:
            fn = BUILTIN_TOOLS[spec]
            name, (description, parameters) = fn.__name__, function_schema(fn, spec)
        else:
            name, description, parameters = _user_tool_schema(spec, limits)
        if name in tools:
            raise ValueError(f"{FIELD}: two tools are named {name!r} ({tools[name].target} and "
                             f"{spec}); tool names must be unique")
        tools[name] = Tool(name=name, description=description, parameters=parameters,
                           target=spec, limits=limits)
    return tuple(tools.values())


def _user_tool_schema(spec: str, limits: Limits) -> tuple[str, str, dict]:
    """(name, description, parameters) of the user tool `spec`, derived in the sandbox."""
    module, _, function = spec.partition(":")
    if not module or not function:
        raise ValueError(f"{FIELD}: unknown tool {spec!r}: use a built-in "
                         f"({', '.join(BUILTIN_TOOLS)}) or name a function as 'module:function'")
    result = describe_function(module, function, limits)
    try:
        found = json.loads(result.stdout) if result.ok else {}
    except json.JSONDecodeError:
        found = {}
    if "name" in found:
        return found["name"], found["description"], found["parameters"]
    problem, detail = found.get("problem", ""), found.get("detail", "")
    if problem == "import":
        raise ValueError(import_failure(FIELD, module, detail))
    messages = {
        "raised": f"{FIELD}: importing {module!r} raised {detail}",
        "attribute": f"{FIELD}: {module} has no attribute {function!r}",
        "not_function": f"{FIELD}: tool {spec!r} is a {detail}, not a function",
        "schema": detail}
    if problem in messages:
        raise ValueError(messages[problem])
    why = (result.stderr.strip().splitlines() or [result.limit or "no output"])[-1]
    raise ValueError(f"{FIELD}: loading tool {spec!r} in the sandbox failed ({why})")


def check_arguments(arguments: object, parameters: dict) -> str:
    """'' when `arguments` fit the schema, else what is wrong (the model sees it)."""
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {json.dumps(arguments)[:80]}"
    props = parameters["properties"]
    unknown = sorted(set(arguments) - set(props))
    if unknown:
        return f"unknown argument(s) {unknown}; the parameters are {sorted(props)}"
    missing = [k for k in parameters["required"] if k not in arguments]
    if missing:
        return f"missing required argument(s) {missing}"
    for key, value in arguments.items():
        if not _fits(value, props[key]):
            return f"argument {key!r}={json.dumps(value)[:80]} is not of type {props[key]['type']}"
    return ""


def _fits(value: object, schema: dict) -> bool:
    kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    if value is None:
        return "null" in kinds
    if "enum" in schema and value not in schema["enum"]:
        return False
    for kind in kinds:
        if kind == "integer" and isinstance(value, int) and not isinstance(value, bool):
            return True
        if kind == "number" and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if (kind, type(value)) in (("string", str), ("boolean", bool), ("object", dict)):
            return True
        if kind == "array" and isinstance(value, list):
            return "items" not in schema or all(_fits(v, schema["items"]) for v in value)
    return False


# ---------------------------------------------------------------------------------------------
# results as text


def _calculate(expression: str, limits: Limits) -> tuple[str, bool]:
    try:
        return clip(calculator(expression), limits.output_bytes), False
    except ZeroDivisionError:
        return "error: division by zero", True
    except ValueError as e:  # CalculatorError
        return f"error: {e}", True


def _describe(result: SandboxResult, limits: Limits, call: bool = False) -> tuple[str, bool]:
    """(text, error) of a sandboxed run. Code: its stdout then stderr. A call: its result on
    success (the function's prints are dropped), else its prints and traceback."""
    output = result.stdout + result.stderr
    if call and result.ok:
        return clip(result.stdout, limits.output_bytes), False
    if result.ok:
        return clip(output, limits.output_bytes) or "(no output)", False
    reason = {
        "wall": f"timed out after {limits.wall_s:g} s; the process was killed",
        "output": f"output truncated at {limits.output_bytes} bytes; the process was stopped",
        "cpu": f"CPU time limit ({limits.cpu_s:g} s) exceeded",
        "killed": "killed (CPU time or memory limit)",
        "memory": f"memory limit ({limits.memory_mb} MB) exceeded",
        "file size": "file size limit exceeded",
        "sandbox": "the sandbox could not run the code",
    }.get(result.limit, f"exit status {result.exit_code}")
    body = clip(output, limits.output_bytes).rstrip("\n")
    return (f"{body}\n[error: {reason}]" if body else f"[error: {reason}]"), True


def clip(text: str, max_bytes: int) -> str:
    """`text` cut to `max_bytes` of UTF-8 (on a character boundary), with a marker if cut."""
    data = text.encode("utf-8")
    if len(data) <= max_bytes:
        return text
    return data[:max_bytes].decode("utf-8", errors="ignore") + f"\n[truncated at {max_bytes} bytes]"
