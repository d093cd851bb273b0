"""Preference optimisation (DPO and its variants) over packed pairs whose prompt is computed once.

- `objective`: the plug-in (`Preference`) the loop steps with;
- `loss`: the per-pair losses, the step objective and TRL's records, from per-response sums;
- `step`: one micro-batch's loss in a training step (the reference's log-probs included);
- `reference`: the reference log-probs of full fine-tuning, computed once before the first step;
- `settings`: the automatic reference decided, and the [dpo] settings' checks.
"""
