"""The GRPO step: the Trainer and its stages (batch building and advantages, the stale-batch
policy, token balancing, the forward/backward passes and their losses), the cold start and the
held-out stop.

Modules: advantage, balance, cold_start, eval_target, losses, offpolicy, passes, trainer.
"""
