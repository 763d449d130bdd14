"""The rollout stage: the collector (prompts -> engines -> rewards), the stream the trainer pulls
batches from, separate placement's rollout ranks.

Modules: collect, placement, sample_channel, stream.
"""
