"""Reinforcement learning's loop around the trainer (issue 48), being built:
- `weights`: the trainer's weights exported for an inference engine, in buckets of its checkpoint's
  names and layout, and a Hugging Face folder sender;
- `engine`: an inference engine behind one interface (transformers' `generate` on the CPU), whose
  rollouts are rows `data.format = "rollouts"` reads;
- `rewards`: verifiable rewards a run names.
Not yet: the trainer interface for RL frameworks, vLLM's and SGLang's senders and engines, `mop rl`.
"""
