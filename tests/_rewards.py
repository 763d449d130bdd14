"""User rewards (`module:function`) for trainer tests."""
from tests._fault_hooks import maybe_die


def length_reward(completion: str, answer: str) -> float:
    """Varies across a group even for a random model, so advantages are non-zero. Dies where
    a test plants it (`tests._fault_hooks.maybe_die`: an environment variable)."""
    maybe_die()
    return len(completion) / 10.0
