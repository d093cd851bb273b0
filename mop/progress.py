"""The training progress bar, which moves inside a step: at long context one step takes minutes.

The bar counts optimizer steps, and each step advances it in equal parts, one per block forward
and one per block backward of each micro-batch (2 x layers x micro-batches parts): a forward hook
on every block marks its forward done and hooks the block's output, whose gradient marks the
backward reaching the block. tqdm turns that into a rate and an ETA. The hooks only count; at the
end of each step the bar is set to the exact step count and shows the step's loss.

It writes to stderr. When stderr is not a terminal (a Slurm log, a redirect), a redrawn bar would
be one endless line: there is no bar then, and every `every` steps (and at the last) one plain
line says the step, its values, the elapsed time and the estimated time left.
"""

from __future__ import annotations

import sys
import time

import torch
from torch import nn
from tqdm import tqdm


class StepProgress:
    def __init__(self, blocks: nn.ModuleList, first_step: int, steps: int, micro_batches: int, enabled: bool,
                 every: int = 10, stream=None):
        stream = stream or sys.stderr
        self.lines = enabled and not stream.isatty()  # plain lines instead of a bar
        self.stream, self.every, self.first, self.steps = stream, every, first_step, steps
        self.start = time.perf_counter()
        self.bar = tqdm(total=steps, initial=first_step, disable=not enabled or self.lines, file=stream,
                        dynamic_ncols=True, bar_format="{percentage:3.0f}%|{bar}| step {n:.2f}/{total} "
                                                       "[{elapsed}<{remaining}{postfix}]")
        self.part = 1.0 / (2 * len(blocks) * micro_batches)
        if enabled and not self.lines:
            for block in blocks:
                block.register_forward_hook(self._forward_done)

    def _forward_done(self, module, args, output) -> None:
        if not torch.is_grad_enabled():  # an evaluation's forward is not part of a step
            return
        self.bar.update(self.part)
        hidden = output[0]
        if hidden.requires_grad:
            hidden.register_hook(self._backward_reached)

    def _backward_reached(self, grad) -> None:
        self.bar.update(self.part)

    def step_done(self, done: int, **postfix) -> None:
        """Step `done` (the steps done after it) is done; `postfix`: its values to show."""
        self.bar.n = done
        self.bar.set_postfix(postfix, refresh=True)
        if self.lines and (done % self.every == 0 or done == self.steps):
            elapsed = time.perf_counter() - self.start
            left = elapsed / (done - self.first) * (self.steps - done)
            values = " ".join(f"{key}={value}" for key, value in postfix.items())
            print(f"step {done}/{self.steps} {values} elapsed {elapsed:.0f} s, about {left:.0f} s left",
                  file=self.stream, flush=True)

    def close(self) -> None:
        self.bar.close()
