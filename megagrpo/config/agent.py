"""Multi-turn (agentic) rollouts: the environment a trajectory talks to, its tools and budgets."""
from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from megagrpo.config.section import Section

REWARD_MODES = ("sum", "last", "none")
SANDBOX_MODES = ("kernel", "weak")
ENV_ERROR_MODES = ("drop", "keep")
OPENENV = "openenv:"
"""agent.environment's prefix of an OpenEnv environment (megagrpo.agent.hub_openenv)."""
URL_SCHEMES = ("http", "https", "ws", "wss")


@dataclass(kw_only=True)
class AgentConfig(Section):
    """Off (environment empty): one completion per prompt. On: each sample is a trajectory of
    assistant turns and environment observations, one token sequence, the observations masked
    out of the loss (megagrpo.agent)."""

    environment: str = ""
    """`module:Class` of an `megagrpo.agent.Environment`, 'tools' for the built-in
    tool-calling environment, or an OpenEnv environment run unmodified:
    'openenv:module:Class' (an `openenv.core` Environment subclass, in this process) or
    'openenv:http://host:port' (its server; agent.kwargs action_field / observation_field /
    role, docs/agentic.md); '' = single-turn rollouts."""
    kwargs: dict = field(default_factory=dict)
    """Keyword arguments of the environment's constructor."""
    tools: list[str] = field(default_factory=list)
    """Tools of the 'tools' environment: built-in names ('calculator', 'python') or
    `module:function` (typed parameters, a docstring; the JSON schema comes from the hints)."""
    max_turns: int = 4
    """Most assistant turns per trajectory (rollout.max_tokens bounds each turn; a turn that
    hits it ends the trajectory, truncation 'turn_length'). An environment not done after the
    last turn: truncation 'max_turns'. Both count as truncated (finish 'length') for
    algo.mask_truncated."""
    max_total_tokens: int = 0
    """Most tokens after the prompt (assistant + environment) per trajectory; 0 =
    rollout.max_model_len minus the prompt. Each turn samples at most what is left; a turn cut
    there, or an observation that would leave no room, ends the trajectory (truncation
    'token_budget'). It is also the limit of algo.overlong_buffer's shaping in multi-turn runs.
    Preflight: the longest prompt plus it must fit rollout.max_model_len."""
    env_reward: str = "sum"
    """How the environment's per-turn rewards join the reward terms' score: 'sum' adds them all,
    'last' adds the final turn's, 'none' ignores them."""
    env_retries: int = 2
    """An environment that raises while it is created or stepped, takes longer than
    agent.env_timeout_s, or answers with garbage (not an Observation, a non-finite reward, ids
    outside the vocabulary) is asked again, the same turn, up to this many times; then the
    trajectory fails (truncation 'env_error') and agent.on_env_error says what becomes of it. A
    step that timed out is not asked again (its thread may still run on the environment)."""
    env_timeout_s: float = 0.0
    """Wall-clock limit of one environment call (creating, stepping); 0 = none. A call past it
    fails the trajectory; Python cannot stop its thread, which is left to finish on its own
    (tools run in the kernel sandbox and are killed at agent.tool_timeout_s)."""
    on_env_error: str = "drop"
    """A failed trajectory: 'drop' takes it out of training (its group's advantages are those
    of the other samples, it has no loss; counted in the step's dropped_frac), 'keep' trains
    it with the rewards it had when it stopped."""
    tool_timeout_s: float = 10.0
    """Wall-clock limit of one tool call (the child process is killed after it)."""
    tool_cpu_s: float = 5.0
    """CPU-time limit of one tool call (RLIMIT_CPU)."""
    tool_memory_mb: int = 512
    """Address-space limit of each process of a tool call (RLIMIT_AS) and, where the call gets
    a cgroup scope, the memory of all its processes together (its tmpfs included)."""
    tool_output_bytes: int = 4096
    """A tool's result is truncated to this many bytes (the model sees a marker)."""
    tool_processes: int = 32
    """Most processes (threads included) of one python/user tool call, all together."""
    sandbox: str = "kernel"
    """How the python tool and user tools are isolated. 'kernel': each call in fresh
    namespaces (bubblewrap: read-only filesystem view, tmpfs scratch, no network, its own pid
    namespace, an unprivileged user), whole-call limits in a cgroup where one can be made;
    where that cannot run, those tools are refused before compute. 'weak': a child process
    behind a Python audit hook, which is no security boundary; only for machines without
    user namespaces and code you trust."""

    def validate(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"agent.max_turns={self.max_turns} must be >= 1")
        if self.max_total_tokens < 0:
            raise ValueError(f"agent.max_total_tokens={self.max_total_tokens} must be >= 0 "
                             "(0 = rollout.max_model_len minus the prompt)")
        if self.env_reward not in REWARD_MODES:
            raise ValueError(f"agent.env_reward={self.env_reward!r}: use one of {REWARD_MODES}")
        if self.environment and self.environment != "tools" and ":" not in self.environment:
            raise ValueError(f"agent.environment={self.environment!r}: name a class as "
                             "'module:Class' or use 'tools' (the built-in tool environment)")
        if self.environment.startswith(OPENENV):
            check_openenv_target(self.environment)
        if self.env_retries < 0:
            raise ValueError(f"agent.env_retries={self.env_retries} must be >= 0")
        if self.env_timeout_s < 0:
            raise ValueError(f"agent.env_timeout_s={self.env_timeout_s} must be >= 0 (0 = none)")
        if self.on_env_error not in ENV_ERROR_MODES:
            raise ValueError(f"agent.on_env_error={self.on_env_error!r}: use one of "
                             f"{ENV_ERROR_MODES}")
        if self.sandbox not in SANDBOX_MODES:
            raise ValueError(f"agent.sandbox={self.sandbox!r}: use one of {SANDBOX_MODES} "
                             "('weak' only where kernel namespaces are unavailable)")
        if self.tools and self.environment != "tools":
            raise ValueError(f"agent.tools={self.tools} needs agent.environment=tools")
        if self.environment == "tools" and not self.tools:
            raise ValueError("agent.environment=tools needs agent.tools, e.g. [calculator]")
        for name, value in (("tool_timeout_s", self.tool_timeout_s),
                            ("tool_cpu_s", self.tool_cpu_s),
                            ("tool_memory_mb", self.tool_memory_mb),
                            ("tool_output_bytes", self.tool_output_bytes),
                           ("tool_processes", self.tool_processes)):
            if value <= 0:
                raise ValueError(f"agent.{name}={value} must be > 0")

    @property
    def reward_join(self) -> str:
        """How trajectories' environment rewards join the reward source's: agent.env_reward,
        'none' without the agent."""
        return self.env_reward if self.enabled else "none"

    @property
    def enabled(self) -> bool:
        return bool(self.environment)


def check_openenv_target(spec: str) -> None:
    """'openenv:module:Class' or 'openenv:<scheme>://host:port[/path]' (an OpenEnv server);
    ValueError naming agent.environment otherwise (the URL is parsed, not yet asked)."""
    target = spec[len(OPENENV):]
    if "://" in target:
        url = urlsplit(target)
        try:
            port = url.port
        except ValueError:
            port = -1
        if url.scheme not in URL_SCHEMES or not url.hostname or port == -1 \
                or url.query or url.fragment:
            raise ValueError(f"agent.environment={spec!r}: the OpenEnv server's URL does not "
                             f"parse as {'/'.join(URL_SCHEMES)}://host[:port][/path], e.g. "
                             "'openenv:http://127.0.0.1:8000'")
        return
    module, _, cls = target.partition(":")
    if not module or not cls or ":" in cls:
        raise ValueError(f"agent.environment={spec!r}: name an OpenEnv environment as "
                         "'openenv:module:Class' (an openenv.core Environment subclass) or "
                         "'openenv:http://host:port' (its server)")
