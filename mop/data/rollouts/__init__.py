"""Recorded rollouts (`data.format = "rollouts"`, reinforcement learning): the rows an engine's
samples are written as, each rollout trained whole.

- `rows`: a row read and checked into tokens, generated-token targets, sampling log-probs, its
  learning signal and its recorded routes (`RolloutRows`);
- `corpus`: a source's rows gathered, GRPO's advantages computed from rewards (`read_rollouts`,
  `RolloutCorpus`), with what a run reads them with (`RolloutSettings`); never prepared;
- `packing`: whole rollouts packed into training sequences with their per-token values
  (`RolloutDataset`).
"""
