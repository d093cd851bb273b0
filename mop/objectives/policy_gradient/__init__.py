"""Policy-gradient objectives on recorded rollouts (GRPO and its family; issue 47), being built.

- `loss`: the per-token losses of TRL 1.16's loss types with token- or sequence-level ratios (GSPO),
  the train-inference correction against the engine's sampling log-probs, the k3 KL to the
  reference, and the aggregation of every loss type as per-token weights from the step's global
  counts.
Not yet: the rollout data (`data.format = "rollouts"`), the plug-in registered in
`mop.objectives.OBJECTIVES` with its `[rl]` settings, group advantages, the rollout sums of the
sequence-level ratio across a sequence group, routing replay.
"""
