"""The models: megatron-core's GPTModel for the supported families (and its MoE routing, compiled
layers), the KL reference beside the policy, megatron's DDP and optimizer.

Modules: compile, gpt, moe, optim, reference.
"""
