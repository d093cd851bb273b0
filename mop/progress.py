"""The training progress bar, which moves inside a step: at long context one step takes minutes.

The bar counts optimizer steps, and each step advances it in equal parts, one per block forward
and one per block backward of each micro-batch (2 x layers x micro-batches parts): a forward hook
on every block marks its forward done and hooks the block's output, whose gradient marks the
backward reaching the block. tqdm turns that into a rate and an ETA. The hooks only count; at the
end of each step the bar is set to the exact step count and shows the step's loss.
"""

from __future__ import annotations

import sys

from torch import nn
from tqdm import tqdm


class StepProgress:
    def __init__(self, blocks: nn.ModuleList, first_step: int, steps: int, micro_batches: int, enabled: bool):
        self.bar = tqdm(total=steps, initial=first_step, disable=not enabled, file=sys.stdout, dynamic_ncols=True,
                        bar_format="{percentage:3.0f}%|{bar}| step {n:.2f}/{total} "
                                   "[{elapsed}<{remaining}{postfix}]")
        self.part = 1.0 / (2 * len(blocks) * micro_batches)
        if enabled:
            for block in blocks:
                block.register_forward_hook(self._forward_done)

    def _forward_done(self, module, args, output) -> None:
        self.bar.update(self.part)
        hidden = output[0]
        if hidden.requires_grad:
            hidden.register_hook(self._backward_reached)

    def _backward_reached(self, grad) -> None:
        self.bar.update(self.part)

    def step_done(self, step: int, **postfix) -> None:
        self.bar.n = step + 1
        self.bar.set_postfix(postfix, refresh=True)

    def close(self) -> None:
        self.bar.close()
