"""megagrpo: iterative GRPO on megatron-core TP/PP models."""
