"""Configuration dataclasses, one small keyword-only dataclass per concern.

Each field carries a one-line docstring (the string literal after it); `megagrpo.config.docs`
turns them into docs/config.md's config reference, so the two never drift apart."""
