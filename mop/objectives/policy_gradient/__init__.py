"""Policy-gradient objectives on recorded rollouts (GRPO and its family; issue 47).

- `objective`: the plug-in (`PolicyGradient`) the loop steps with under `data.format = "rollouts"`;
- `step`: one micro-batch's loss (the reference's KL forward, routing replay R3/R2, the old
  log-probs kept across a batch's updates, the rollout sums through the sequence group) and the
  step's record;
- `loss`: the per-token losses of TRL 1.16's loss types with token- or sequence-level ratios (GSPO),
  the train-inference correction, the k3 KL, and each loss type's aggregation as per-token weights
  from the step's global counts;
- `reference`: the KL's reference log-probs of full fine-tuning, computed once before the first step;
- `settings`: the automatic reference decided, and the [rl] settings' checks;
- `sampling`: rollouts sampled from a model on this machine, written as the rows the objective trains on.
"""
