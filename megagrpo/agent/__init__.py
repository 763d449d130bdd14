"""Multi-turn rollouts with environments and tools (agentic GRPO)."""
from megagrpo.agent.env import Environment, Observation, Turn

__all__ = ["Environment", "Observation", "Turn"]
