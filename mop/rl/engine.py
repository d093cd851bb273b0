"""An inference engine behind one interface: it takes the trainer's weights and samples rollouts in
the rows `data.format = "rollouts"` reads (`mop.data.rollouts.rows`), with what routing replay and the
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

`VLLMServer` and `SGLangServer`: a running server of either, the weights pushed through its
weight-update API (`mop.rl.senders`: a broadcast group, or for vLLM a folder it reloads), rollouts
asked for by token ids at temperature 1 with no top-k, top-p, min-p or penalty: every sampling field
is sent, since vLLM fills an omitted one from the model folder's generation_config.json
(`config/model.py` `get_diff_sampling_param`; a published model's repetition penalty, temperature,
top-k ...), and then samples from another distribution than the one whose log-probs it returns.
vLLM's `POST /v1/completions` (`n`, `logprobs: 0` for the sampled token's log-prob,
`return_token_ids`, `seed`; choices prompt-major) and SGLang's `POST /generate`
(`sampling_params.n`, `return_logprob`, `logprob_start_len: -1`; a flat list, prompt-major; its seed
works only under deterministic inference, so none is sent). Both keep the end-of-text token with its
log-prob, and return the routed experts (with the server's `--enable-return-routed-experts`) in the
forms the rollout reader takes. Their log-probs are the model's at temperature 1, the distribution
sampled (vLLM: with `--logprobs-mode processed_logprobs` they stay so whatever a request sets).
Before its first sync a `VLLMServer` asks the server what it loaded (`GET /server_info`: its
`quantization`) and refuses weights in another form (bf16 to a server of fp8 blocks leaves its scales
as they were: silently wrong weights; `rl.sync_dtype`). Read from their sources
(mop/rl/PROTOCOLS.md); vLLM's CPU build serves the engine tier (`tests/test_engine_vllm.py`),
SGLang a stand-in (`tests/test_rl_senders.py`).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path

import torch

from mop.rl.senders import EngineClient, EngineError, SGLangSender, VLLMFolderSender, VLLMSender
from mop.rl.weights import Bucket, save_folder

ROUTER = re.compile(r"^model\.layers\.(\d+)\.mlp\.gate$")


class Engine(ABC):
    """What the RL loop asks of an inference engine."""

    @abstractmethod
    def take(self, buckets: Iterable[Bucket], config: dict) -> None:
        """The trainer's weights as rank 0 exports them (`mop.rl.weights.weight_buckets`), of the Hugging
        Face `config` (its config.json)."""

    @abstractmethod
    def sample(self, prompts: list[list[int]], group: int, max_new_tokens: int, seed: int) -> list[dict]:
        """`group` rollouts of each prompt as rollout rows (`prompt_ids`, `completion_ids`,
        `sampling_logps`, `routed_experts`), prompts in order."""

    def close(self) -> None:
        """End what the engine holds open (a server's sender: its thread and weight group)."""


class TransformersEngine(Engine):
    """transformers' model and `generate` on the CPU (module docstring)."""

    def __init__(self, eos_id: int, folder: Path | None = None):
        self.eos_id, self.folder, self.model = eos_id, folder, None

    def take(self, buckets: Iterable[Bucket], config: dict) -> None:
        """The buckets written to the engine's folder, then loaded (module docstring)."""
        self.load(save_folder(buckets, self.folder, config))

    def load(self, folder: Path) -> None:
        """The weights of a Hugging Face folder (`mop.rl.weights.write_folder`'s)."""
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


class _Server(Engine):
    """What both server engines share: their sender, connected at the first push."""

    def close(self) -> None:
        self.sender.close()


NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
           "presence_penalty": 0.0, "frequency_penalty": 0.0}
"""Sampling from the model's own distribution, every field a server would otherwise fill from the
model's generation_config.json (module docstring)."""


class VLLMServer(_Server):
    """A running vLLM server (module docstring); `model`: its served model's name ("": the server's one)."""

    def __init__(self, url: str, sender: VLLMSender | VLLMFolderSender, model: str = "", timeout_s: float = 600.0):
        self.client, self.sender, self.model, self.version = EngineClient(url, timeout_s), sender, model, 0

    def take(self, buckets: Iterable[Bucket], config: dict) -> None:
        if self.version == 0:
            self.check_format(config)
        _push(self, buckets)

    def check_format(self, config: dict) -> None:
        """Refuse weights in another form than the server's (module docstring): `config` is what is sent."""
        info = str(self.client.get("/server_info").get("vllm_config", ""))  # vllm/config/vllm.py's summary
        quantization = re.search(r"\bquantization=([\w-]+)", info)
        if quantization is None:  # a vLLM that does not say
            return
        served = None if quantization.group(1) == "None" else quantization.group(1)
        sent = (config.get("quantization_config") or {}).get("quant_method")
        if served != sent:
            raise EngineError(f"rl.sync_dtype: the server at {self.client.url} serves {served or 'unquantized'} "
                              f"weights and the run would send {sent or 'unquantized'} ones, which it would load "
                              "wrongly; send the checkpoint's published format (rl.sync_dtype = published) to a "
                              "server of the published checkpoint, or serve mop convert to-hf's export")

    def sample(self, prompts: list[list[int]], group: int, max_new_tokens: int, seed: int) -> list[dict]:
        body = {**({"model": self.model} if self.model else {}), "prompt": prompts, "n": group,
                "max_tokens": max_new_tokens, **NEUTRAL, "logprobs": 0, "return_token_ids": True,
                "skip_special_tokens": False, "seed": seed, "routed_experts_prompt_start": 0}
        choices = sorted(self.client.post("/v1/completions", body)["choices"], key=lambda c: c["index"])
        return [_row(prompts[c["index"] // group], c["token_ids"], c["logprobs"]["token_logprobs"],
                     c.get("routed_experts")) for c in choices]


class SGLangServer(_Server):
    """A running SGLang server (module docstring)."""

    def __init__(self, url: str, sender: SGLangSender, timeout_s: float = 600.0):
        self.client, self.sender, self.version = EngineClient(url, timeout_s), sender, 0

    def take(self, buckets: Iterable[Bucket], config: dict) -> None:
        _push(self, buckets)

    def sample(self, prompts: list[list[int]], group: int, max_new_tokens: int, seed: int) -> list[dict]:
        body = {"input_ids": prompts, "return_logprob": True, "logprob_start_len": -1, "top_logprobs_num": 0,
                "return_routed_experts": True, "routed_experts_start_len": 0,
                "sampling_params": {"max_new_tokens": max_new_tokens, **NEUTRAL, "n": group,
                                    "skip_special_tokens": False}}
        outputs = self.client.post("/generate", body)
        outputs = outputs if isinstance(outputs, list) else [outputs]
        return [_row(prompts[k // group], out["output_ids"], [t[0] for t in out["meta_info"]["output_token_logprobs"]],
                     out["meta_info"].get("routed_experts")) for k, out in enumerate(outputs)]


def _push(engine: VLLMServer | SGLangServer, buckets: Iterable[Bucket]) -> None:
    """The buckets through the engine's sender (joining its group first), as weight version 1, 2, ..."""
    if engine.version == 0:
        engine.sender.connect()
    engine.version += 1
    engine.sender.send(buckets, str(engine.version))


def _row(prompt: list[int], completion: list[int], logps: list[float], routes) -> dict:
    return {"prompt_ids": prompt, "completion_ids": completion, "sampling_logps": logps,
            **({"routed_experts": routes} if routes is not None else {})}
