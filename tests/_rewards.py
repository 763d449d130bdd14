"""User rewards (`module:function`) for trainer tests."""


def length_reward(completion: str, answer: str) -> float:
    """Varies across a group even for a random model, so advantages are non-zero."""
    return len(completion) / 10.0
