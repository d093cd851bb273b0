"""Reinforcement learning's loop around the trainer (issue 48):
- `feed`: the loop's data, each batch's rollouts sampled by the engine with the synced weights,
  rewarded and packed as recorded rollouts (what `mop rl` trains on);
- `prompts`: the prompts and their answers (`rl.prompts`);
- `weights`: the trainer's weights exported for an inference engine, in buckets of its checkpoint's
  names and layout, and a Hugging Face folder sender;
- `senders`: the buckets to a running vLLM or SGLang server over its weight-update API;
- `engine`: an inference engine behind one interface (transformers' `generate` on the CPU, a vLLM or
  SGLang server), whose rollouts are rows `data.format = "rollouts"` reads;
- `rewards`: verifiable rewards a run names.
The trainer an RL framework drives is `mop.trainer` (above `mop.train`, whose step it runs).
"""
