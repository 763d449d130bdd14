"""Multi-turn rollouts with environments and tools (agentic GRPO)."""
from megagrpo.agent.env import Environment, Observation, Turn
from megagrpo.agent.registry import EnvironmentFactory, import_environment, load_environment
from megagrpo.agent.sandbox import Limits, SandboxResult, isolation_problem, network_isolation
from megagrpo.agent.tool_env import ToolEnvironment, check_tool_template, system_tools_prompt
from megagrpo.agent.toolcall import ToolCall, parse_tool_calls
from megagrpo.agent.tools import Tool, ToolResult, load_tools

__all__ = ["Environment", "Observation", "Turn",
           "EnvironmentFactory", "Limits", "SandboxResult", "Tool", "ToolCall",
           "ToolEnvironment", "ToolResult", "check_tool_template", "import_environment",
           "isolation_problem", "load_environment", "load_tools", "network_isolation",
           "parse_tool_calls", "system_tools_prompt"]
