"""agent.environment resolved to a factory of per-trajectory environments, checked before compute.

    factory = load_environment(cfg.agent, tokenizer)   # ValueError on bad input, no compute
    prompt = factory.render_prompt(messages)           # with the tool list for 'tools'
    env = factory(record)                              # one per trajectory
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from megagrpo.agent.env import Environment
from megagrpo.agent.hub_openenv import load_openenv
from megagrpo.agent.sandbox import Limits, announce_isolation, isolation_problem
from megagrpo.agent.tool_env import (
    ToolEnvironment,
    check_tool_template,
    hf_tokenizer,
    system_tools_prompt,
)
from megagrpo.agent.tools import Tool, load_tools
from megagrpo.config.agent import OPENENV, AgentConfig
from megagrpo.config.data import DataConfig
from megagrpo.data import Example, get_field
from megagrpo.runtime.names import import_object

TOOL_ENV_KWARGS = ("max_calls_per_turn",)


@dataclass(frozen=True, kw_only=True)
class EnvironmentFactory:
    """Creates the environment of one trajectory: `cls(record, tokenizer, **kwargs)`."""

    cls: type[Environment]
    tokenizer: object
    kwargs: dict = field(default_factory=dict)
    tools: tuple[Tool, ...] = ()
    """The loaded tools of the 'tools' environment (their schemas go into the prompt)."""

    def __call__(self, record: dict) -> Environment:
        return self.cls(record, self.tokenizer, **self.kwargs)

    def render_prompt(self, messages: list[dict]) -> str:
        """The prompt text: the chat template over `messages` with the generation prompt, and
        the tool list when the environment has tools."""
        if self.tools:
            return system_tools_prompt(self.tokenizer, messages, self.tools)
        return hf_tokenizer(self.tokenizer).apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True)


def load_environment(cfg: AgentConfig, tokenizer: object) -> EnvironmentFactory:
    """agent.environment ('tools', 'module:Class' or 'openenv:...') checked and ready: modules
    imported, tools typed, the chat template's tool support (or, for an OpenEnv environment,
    its message role, action and observation fields: megagrpo.agent.hub_openenv) and the
    constructor's kwargs checked. Raises ValueError naming the agent.* field otherwise."""
    if cfg.environment == "tools":
        unknown = sorted(set(cfg.kwargs) - set(TOOL_ENV_KWARGS))
        if unknown:
            raise ValueError(f"agent.kwargs {unknown}: the 'tools' environment accepts "
                             f"{list(TOOL_ENV_KWARGS)}")
        most = cfg.kwargs.get("max_calls_per_turn", 1)
        if isinstance(most, bool) or not isinstance(most, int) or most < 1:
            raise ValueError(f"agent.kwargs max_calls_per_turn={most!r} must be an int >= 1")
        check_sandbox(cfg)
        tools = load_tools(cfg.tools, Limits.from_config(cfg))
        template = check_tool_template(tokenizer, tools)
        return EnvironmentFactory(cls=ToolEnvironment, tokenizer=tokenizer, tools=tools,
                                  kwargs={"tools": tools, "template": template, **cfg.kwargs})
    if cfg.environment.startswith(OPENENV):
        cls, kwargs = load_openenv(cfg, tokenizer)
        return EnvironmentFactory(cls=cls, tokenizer=tokenizer, kwargs=kwargs)
    cls = import_environment(cfg.environment)
    try:
        inspect.signature(cls).bind({}, tokenizer, **cfg.kwargs)
    except TypeError as e:
        raise ValueError(f"agent.kwargs {cfg.kwargs} do not fit {cfg.environment}"
                         f"(record, tokenizer, **kwargs): {e}") from None
    return EnvironmentFactory(cls=cls, tokenizer=tokenizer, kwargs=dict(cfg.kwargs))


def check_sandbox(cfg: AgentConfig) -> None:
    """When a tool runs code (the python tool, any user tool): ValueError naming
    agent.sandbox and the fix if its isolation cannot run here, checked before a user tool
    module is imported; else says once on the console which isolation runs."""
    if all(spec == "calculator" for spec in cfg.tools):
        return
    problem = isolation_problem(cfg.sandbox)
    if problem:
        raise ValueError(problem)
    announce_isolation(cfg.sandbox)


def with_tool_prompts(examples: list[Example], factory: EnvironmentFactory,
                      data: DataConfig) -> list[Example]:
    """The examples' prompts rendered again with the tool list (`render_prompt`): the 'tools'
    environment's model must see the tools' schemas. Needs data.template=chat (the prompt is
    the chat template's, which is where the tool list goes); ValueError otherwise."""
    if not factory.tools:
        return examples
    if data.template != "chat":
        raise ValueError(f"agent.environment=tools renders the tool list through the chat "
                         f"template: set data.template=chat (it is {data.template!r})")
    out = []
    for e in examples:
        messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt \
            else []
        messages.append({"role": "user", "content": str(get_field(e.record, data.prompt_field))})
        out.append(Example(prompt=factory.render_prompt(messages), answer=e.answer,
                           record=e.record))
    return out


def import_environment(spec: str) -> type[Environment]:
    """The class `module:Class` names; ValueError naming agent.environment if it cannot be
    imported or is not an Environment subclass."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"agent.environment={spec!r}: name a class as 'module:Class' or use "
                         "'tools'")
    target = import_object(spec, f"agent.environment={spec!r}")
    if not (isinstance(target, type) and issubclass(target, Environment)):
        raise ValueError(f"agent.environment={spec!r} is not a subclass of "
                         "megagrpo.agent.Environment (subclass it and implement step)")
    return target
