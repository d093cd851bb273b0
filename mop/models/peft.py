"""LoRA adapters in PEFT's layout: the files `PeftModel.from_pretrained` loads onto the Hugging Face model.

`adapter_config.json` names the adapted attention projections by their HF module paths
(`target_modules`, full paths, so that only the adapted layers match) and the other adapted weights
by parameter (`target_parameters`, PEFT's parameter targeting): the routed experts' fused tensors
(`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) and the dense and shared MLPs' linear weights
by full path (`model.layers.0.mlp.gate_proj.weight`). PEFT (0.21) reads a `target_modules` entry
named like a pre-fusion expert projection (`gate_proj`, `up_proj`, `down_proj`) of a Qwen2-style MoE
(Qwen3-MoE, DeepSeek-V3, GLM-4.5) as the experts' fused tensor, so an MLP's own linear layers are
only reachable by their weights; either way PEFT computes `W + scaling B A`. `adapter_model.safetensors`
holds, under `base_model.model.<HF module>`:
- a linear layer's `lora_A.weight [r, in]` and `lora_B.weight [out, r]`, as mop keeps them;
- a fused expert tensor's `lora_A.weight [E r, in]` (expert e's rows `[e r, (e + 1) r)`) and
  `lora_B.weight [out, r E]` (expert e's column k at `k E + e`), from mop's stacked `[E, r, in]` and
  `[E, out, r]`. PEFT wraps the targeted parameters of one module one inside the other in
  `target_parameters`' order, so the first one's adapters sit under `experts.base_layer.`, the
  last one's under `experts.` itself.
`scaling = lora_alpha / r` in both; PEFT's defaults otherwise (no rslora, no DoRA, no bias).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from mop.models.config import ModelConfig
from mop.models.families import FAMILIES
from mop.models.hf_mapping import model_pieces
from mop.models.lora import LoraConfig, adaptable_modules
from mop.models.moe import MoE
from mop.models.transformer import MoETransformer

PREFIX = "base_model.model."
WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"


def hf_names(cfg: ModelConfig) -> dict[str, str]:
    """The HF tensor name of every mop parameter that is one whole checkpoint tensor (the experts in
    the stacked layout transformers keeps in memory)."""
    pieces = model_pieces(cfg, FAMILIES[cfg.family].hf, set(range(cfg.layers)))
    names = {}
    for piece in pieces:
        if piece.index == ():
            names.setdefault(piece.param, piece.key)  # an MTP layer's copies of the embedding and head come after
    return names


def adapter_names(cfg: ModelConfig, lora: LoraConfig) -> dict[str, str]:
    """Every adapter of the model, mop name -> PEFT key."""
    with torch.device("meta"):
        model = MoETransformer(cfg, lora)
    names, out = hf_names(cfg), {}
    for path, module in model.named_modules():
        if getattr(module, "rank", 0) and hasattr(module, "lora_A"):  # an adapted linear layer
            hf_module = names[f"{path}.weight"].removesuffix(".weight")
            out.update({f"{path}.lora_{x}": f"{PREFIX}{hf_module}.lora_{x}.weight" for x in "AB"})
        elif isinstance(module, MoE) and getattr(module.experts.kind, "rank", 0):
            projections = module.experts.kind.projections
            for depth, projection in enumerate(projections):
                hf_param = names[f"{path}.experts.{projection.name}"]
                owner = hf_param.rsplit(".", 1)[0] + ".base_layer" * (len(projections) - 1 - depth)
                out.update({f"{path}.experts.{projection.name}_lora_{x}": f"{PREFIX}{owner}.lora_{x}.weight"
                            for x in "AB"})
    return out


def to_peft(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A mop adapter as PEFT stores it (module docstring)."""
    if tensor.dim() == 2:
        return tensor
    experts, rows, columns = tensor.shape
    if name.endswith("lora_A"):  # [E, r, in] -> [E r, in]
        return tensor.reshape(experts * rows, columns)
    return tensor.permute(1, 2, 0).reshape(rows, columns * experts)  # [E, out, r] -> [out, r E]


def from_peft(name: str, tensor: torch.Tensor, experts: int | None) -> torch.Tensor:
    """`to_peft`'s inverse; `experts`: E for a fused expert tensor's adapter, None for a linear layer's."""
    if experts is None:
        return tensor
    if name.endswith("lora_A"):
        return tensor.reshape(experts, -1, tensor.shape[-1])
    return tensor.reshape(tensor.shape[0], -1, experts).permute(2, 0, 1)


def adapter_config(cfg: ModelConfig, lora: LoraConfig) -> dict:
    """adapter_config.json for the model's adapters."""
    with torch.device("meta"):
        model = MoETransformer(cfg)
    targets = set(lora.target_list())
    names = hf_names(cfg)
    modules, parameters = [], []
    for path, kind, leaf in adaptable_modules(model):
        if kind not in targets and leaf not in targets:
            continue
        if kind == "routed_experts":
            layer = path.split(".")[1]
            for projection in model.get_submodule(path).kind.projections:
                name = names[f"{path}.{projection.name}"].removeprefix(f"model.layers.{layer}.")
                if name not in parameters:
                    parameters.append(name)
        elif kind == "attention":
            modules.append(names[f"{path}.weight"].removesuffix(".weight"))
        else:  # an MLP's linear layer, by its weight (module docstring)
            parameters.append(names[f"{path}.weight"])
    # PEFT's parameter targeting refuses dropout; it changes nothing where the adapters serve
    dropout = 0.0 if parameters else lora.dropout
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None, "r": lora.rank,
            "lora_alpha": lora.alpha, "lora_dropout": dropout, "target_modules": modules,
            "target_parameters": parameters or None, "bias": "none", "use_rslora": False, "use_dora": False,
            "fan_in_fan_out": False, "init_lora_weights": True, "modules_to_save": None, "inference_mode": True}


def save_peft(directory, cfg: ModelConfig, lora: LoraConfig, adapters: dict[str, torch.Tensor],
              dtype: torch.dtype | None = None) -> None:
    """Write the adapters (mop name -> whole tensor) to `directory` in PEFT's layout, cast to `dtype`
    (None: as they are)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    names = adapter_names(cfg, lora)
    tensors = {names[name]: to_peft(name, t).detach().to("cpu", dtype or t.dtype).contiguous()
               for name, t in adapters.items()}
    save_file(tensors, directory / WEIGHTS, metadata={"format": "pt"})
    (directory / CONFIG).write_text(json.dumps(adapter_config(cfg, lora), indent=2) + "\n")
