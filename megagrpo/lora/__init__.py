"""LoRA: adapters on the policy's linears, the reference as the adapters off, the reset as a merge
(`layers`); a LoRA run's checkpoint, the adapters in every one and the base only when it changed
(`checkpoint`); the peft adapter folder (`export`). How vLLM gets the adapters is the weight
sync's (`megagrpo.sync.adapters`); their counts come from the parameter layout
(`megagrpo.config.params`). docs/lora.md."""
