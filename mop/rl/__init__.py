"""Reinforcement learning's loop around the trainer (issue 48), being built: the trainer's weights
exported for an inference engine in its checkpoint names (`weights`)."""
