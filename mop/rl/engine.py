"""An inference engine behind one interface: it takes the trainer's weights and samples rollouts in
the rows `data.format = "rollouts"` reads (`mop.data.rollouts`), with what routing replay and the
train-inference correction need (sampling log-probs, routed experts).

`TransformersEngine` (the tests' engine, on the CPU): a Hugging Face model loaded from the folder
the trainer's weights were sent to (`mop.rl.weights.write_folder`), reloaded on each update (a folder,
not the buckets in memory: transformers 5 turns the hub's per-expert tensors into its fused expert
modules as it loads a checkpoint, which a copy into its state dict would skip). It draws
`group` completions of each prompt with transformers' `generate` (multinomial at temperature 1,
no top-k or top-p, from `torch.manual_seed(seed)`: generate draws from torch's global generator),
each cut after its first end-of-text token; each completion token's sampling log-prob is the
log-softmax of the logits generate produced for it (what vLLM returns as processed log-probs at
temperature 1); the routed experts come from one forward over each whole sequence, read from every
MoE layer's router (`model.layers.{i}.mlp.gate`, whose last output is its top-k ids in transformers
5), in vLLM's form: `[tokens - 1, layers, top_k]`, the dense layers' rows 0.

vLLM and SGLang engines (their weight-update and generation APIs) are not built
(`NotImplementedError`).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from pathlib import Path

import torch

ROUTER = re.compile(r"^model\.layers\.(\d+)\.mlp\.gate$")


class Engine(ABC):
    """What the RL loop asks of an inference engine."""

    @abstractmethod
    def load(self, folder: Path) -> None:
        """Take the weights the trainer sent to `folder` (`mop.rl.weights.write_folder`)."""

    @abstractmethod
    def sample(self, prompts: list[list[int]], group: int, max_new_tokens: int, seed: int) -> list[dict]:
        """`group` rollouts of each prompt as rollout rows (`prompt_ids`, `completion_ids`,
        `sampling_logps`, `routed_experts`), prompts in order."""


class TransformersEngine(Engine):
    """transformers' model and `generate` on the CPU (module docstring)."""

    def __init__(self, eos_id: int):
        self.eos_id, self.model = eos_id, None

    def load(self, folder: Path) -> None:
        import transformers

        transformers.utils.logging.disable_progress_bar()  # a bar per sync would bury the run's own
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, attn_implementation="eager", dtype=torch.float32).eval()

    @torch.no_grad()
    def sample(self, prompts: list[list[int]], group: int, max_new_tokens: int, seed: int) -> list[dict]:
        if self.model is None:
            raise RuntimeError("the engine has no weights yet: load a folder the trainer sent them to")
        torch.manual_seed(seed)
        rows = []
        for prompt in prompts:
            ids = torch.tensor([prompt] * group)
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                                      top_k=0, top_p=1.0, max_new_tokens=max_new_tokens, output_logits=True,
                                      return_dict_in_generate=True, eos_token_id=self.eos_id,
                                      pad_token_id=self.eos_id)
            completions = out.sequences[:, len(prompt):]
            logps = torch.stack(out.logits, 1).float().log_softmax(-1).gather(-1, completions.unsqueeze(-1))[..., 0]
            for row, logp in zip(completions.tolist(), logps):
                n = row.index(self.eos_id) + 1 if self.eos_id in row else len(row)
                rows.append({"prompt_ids": prompt, "completion_ids": row[:n], "sampling_logps": logp[:n].tolist(),
                             "routed_experts": self.routes(prompt + row[:n])})
        return rows

    def routes(self, ids: list[int]) -> list:
        """The experts each token ran through in every layer, `[tokens - 1, layers, top_k]` (module docstring)."""
        chosen: dict[int, torch.Tensor] = {}
        hooks = []
        for name, module in self.model.named_modules():
            layer = ROUTER.match(name)
            if layer is not None:
                hooks.append(module.register_forward_hook(
                    lambda m, args, out, layer=int(layer.group(1)): chosen.__setitem__(layer, out[-1])))
        try:
            self.model(torch.tensor([ids]))
        finally:
            for hook in hooks:
                hook.remove()
        config = self.model.config
        top_k = next(iter(chosen.values())).shape[-1]
        routes = torch.zeros(len(ids), config.num_hidden_layers, top_k, dtype=torch.long)
        for layer, ids_of_layer in chosen.items():
            routes[:, layer] = ids_of_layer.view(len(ids), top_k)
        return routes[:-1].tolist()
