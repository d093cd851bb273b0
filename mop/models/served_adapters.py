"""LoRA adapters in the layout the serving engines load: `serve/` inside every PEFT adapter folder.

PEFT's form (`mop.models.peft`) targets the routed experts as parameters of their fused tensors,
which vLLM (0.33) and SGLang (0.5.23) read for no family but gpt-oss (read from their loaders:
vLLM `lora/utils.py`, `lora_weights.py`, `model_manager.py`; SGLang `lora/utils.py`, `lora.py`,
`mem_pool.py`). The engines' layout, per family:
- where the hub publishes each expert's projections (qwen3_moe, deepseek_v3, glm4_moe, mixtral):
  one adapter per expert and projection under the hub's own module name,
  `base_model.model.model.layers.{L}.mlp.experts.{e}.{gate,up,down}_proj.lora_{A,B}.weight`
  (Mixtral's `block_sparse_moe.experts.{e}.{w1,w3,w2}`), A `[r, in]`, B `[out, r]`, every expert of
  a layer with all three projections (what vLLM's per-expert MoE LoRA asserts and SGLang stacks into
  its gate-up). mop keeps one adapter on the fused gate-up weight `[2I, H]`; its update `B A` is, row
  for row, the gate's `B[:I] A` over the up's `B[I:] A`, so gate and up each get rank r with the
  same A: the function is PEFT's, exactly;
- where the hub publishes fused experts (gpt-oss): PEFT's form itself, which vLLM's 3D MoE LoRA
  reads (`is_3d_moe_weight`): the gate-up adapter under `experts.base_layer.`, the down one under
  `experts.`, A `[E r, in]` (expert e's rows `[e r, (e + 1) r)`), B `[out, r E]` (expert e's column
  k at `k E + e`), gate-up rows interleaved as the weight's. SGLang reads another 3D form and
  takes no expert LoRA over an MXFP4 base: gpt-oss's expert adapters are served with vLLM.
Every other adapter (attention, the dense and shared MLPs) keeps PEFT's key, its module's own name.

`adapter_config.json` lists `target_modules` as leaf module names (SGLang keeps only a name's last
part; vLLM follows the tensors' keys), Mixtral's expert names as SGLang spells them (gate_proj,
up_proj, down_proj for w1, w3, w2), and no `target_parameters` (neither engine reads them).

Known drops (`serving_warnings`, printed at a LoRA run's start and by `mop convert to-peft`): vLLM
loads DeepSeek MLA's `kv_b_proj` adapter but never applies it (vllm-project/vllm#48974); SGLang fails
on a latent attention's `q_proj` adapter (a model with `q_lora_rank` 0) and on `kv_a_proj_with_mqa`'s
without `q_a_proj`'s (it adapts the two as one fused module), and drops shared-expert adapters
where it fuses the shared experts into the routed ones (its default on GPUs for GLM-4.5 and for
DeepSeek-V3 of 256 or 384 routed experts and one shared; `--disable-shared-experts-fusion`); neither
engine adapts the multi-token-prediction layers (mop puts no adapters on them: LoRA keeps them
frozen). vLLM's CPU build takes no LoRA for an MoE model at all: its `--enable-lora` runs every MoE
layer through a Triton kernel the CPU build lacks (the engine tier names it). mop's expert adapters always cover gate, up and down,
the engines' condition for wrapping experts at all.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from mop.models.config import ModelConfig
from mop.models.families import FAMILIES
from mop.models.hf_mapping import model_pieces
from mop.models.lora import AdaptedWeight, LoraConfig, adapted_weights
from mop.models.peft import CONFIG, PREFIX, WEIGHTS, adapter_names, save_peft, to_peft
from mop.models.transformer import MoETransformer

SERVE = "serve"
SGLANG_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
"""Mixtral's expert names as SGLang's `target_modules` normalisation knows them (its loader renames the keys)."""


def per_expert_adapters(cfg: ModelConfig, lora: LoraConfig) -> dict[AdaptedWeight, list[tuple[tuple, str]]]:
    """For each adapted expert weight the hub publishes per expert (its adapters' names), its pieces:
    (index into the stacked weight `(e, rows)` or `(e,)`, hub module). Empty for a family publishing
    fused experts."""
    with torch.device("meta"):
        adapted = adapted_weights(MoETransformer(cfg, lora))
    out: dict[AdaptedWeight, list[tuple[tuple, str]]] = {}
    for piece in model_pieces(cfg, FAMILIES[cfg.family].hf, set()):  # no stacked layers: the hub's layout
        update = adapted.get(piece.param)
        if update is not None and piece.index != ():
            if update.transposed:
                raise NotImplementedError(f"per-expert serving adapters of a transposed expert weight ({piece.param})")
            out.setdefault(update, []).append((piece.index, piece.key.removesuffix(".weight")))
    return out


def save_adapters(directory, cfg: ModelConfig, lora: LoraConfig, adapters: dict[str, torch.Tensor],
                  dtype: torch.dtype | None = None) -> None:
    """Write the adapters (mop name -> whole tensor), cast to `dtype` (None: as they are), in PEFT's
    layout to `directory` (`mop.models.peft.save_peft`) and in the engines' to `directory/serve`."""
    adapters = {name: t.detach().to("cpu", dtype or t.dtype) for name, t in adapters.items()}
    save_peft(directory, cfg, lora, adapters)
    tensors = served_tensors(cfg, lora, adapters)
    serve = Path(directory) / SERVE
    serve.mkdir(parents=True, exist_ok=True)
    save_file(tensors, serve / WEIGHTS, metadata={"format": "pt"})
    (serve / CONFIG).write_text(json.dumps(served_config(lora, tensors), indent=2) + "\n")


def served_tensors(cfg: ModelConfig, lora: LoraConfig, adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The engines' tensors (module docstring) of the mop adapters `adapters` (mop name -> tensor;
    experts' `[E, r, in]` / `[E, out, r]`): PEFT's, each per-expert family's expert adapters split
    into one pair per expert and projection."""
    names = adapter_names(cfg, lora)
    replaced, split = set(), {}
    for update, pieces in per_expert_adapters(cfg, lora).items():
        replaced.update((update.lora_a, update.lora_b))
        for (expert, *rows), module in pieces:  # clones: gate and up get one A as two tensors
            split[f"{PREFIX}{module}.lora_A.weight"] = adapters[update.lora_a][expert].clone()
            split[f"{PREFIX}{module}.lora_B.weight"] = adapters[update.lora_b][expert][tuple(rows)].clone()
    kept = {names[name]: to_peft(name, t).contiguous() for name, t in adapters.items() if name not in replaced}
    return {**kept, **split}


def served_config(lora: LoraConfig, tensors: dict[str, torch.Tensor]) -> dict:
    """adapter_config.json for the engines (module docstring)."""
    modules = set()
    for key in tensors:
        module = key.removeprefix(PREFIX).removesuffix(".lora_A.weight").removesuffix(".lora_B.weight")
        leaf = module.rsplit(".", 1)[-1]
        if leaf in ("experts", "base_layer"):  # gpt-oss's fused experts, read by key: their tensors' names
            modules.update(("gate_up_proj", "down_proj"))
        else:
            modules.add(SGLANG_NAMES.get(leaf, leaf) if ".experts." in module else leaf)
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None, "r": lora.rank,
            "lora_alpha": lora.alpha, "lora_dropout": 0.0, "target_modules": sorted(modules), "bias": "none",
            "use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "init_lora_weights": True,
            "modules_to_save": None, "inference_mode": True}


def serving_warnings(cfg: ModelConfig, lora: LoraConfig) -> list[str]:
    """The adapted modules an engine is known to drop or fail on (module docstring), one line each."""
    with torch.device("meta"):
        names = [name for name, _ in MoETransformer(cfg, lora).named_parameters()]

    def adapts(module: str) -> bool:
        return any(f".{module}.lora_" in name for name in names)

    warnings = []
    if adapts("kv_b_proj"):
        warnings.append("lora.targets adapts kv_b_proj: vLLM (0.33) loads an MLA kv_b_proj adapter but never applies "
                        "it (vllm-project/vllm#48974), so a model served there computes without it; SGLang applies it, "
                        "or drop kv_b_proj from lora.targets (or serve mop convert merge's weights)")
    # SGLang adapts q_a_proj with kv_a_proj_with_mqa as one fused module, found from q_a_proj's adapter
    unloadable = [module for module in ("q_proj", "kv_a_proj_with_mqa") if adapts(module)
                  and not (module == "kv_a_proj_with_mqa" and adapts("q_a_proj"))]
    if cfg.family == "deepseek_v3" and unloadable:
        warnings.append(f"lora.targets adapts {' and '.join(unloadable)} of a latent attention: SGLang (0.5.23) adapts "
                        "q_a_proj with kv_a_proj_with_mqa, q_b_proj, kv_b_proj and o_proj only, and fails on a q_proj "
                        "adapter (KeyError, srt/lora/lora.py:293) or a kv_a_proj_with_mqa one without q_a_proj's (no "
                        "such module, srt/lora/mem_pool.py:983); serve these adapters with vLLM, or set lora.targets "
                        "to kv_b_proj,o_proj and the MLPs")
    fused = cfg.family == "glm4_moe" or (cfg.family == "deepseek_v3" and cfg.experts in (256, 384)
                                          and cfg.shared_expert_intermediate == cfg.expert_intermediate)
    if fused and any(".mlp.shared." in name and ".lora_" in name for name in names):
        warnings.append("lora.targets adapts the shared experts: SGLang (0.5.23) fuses them into the routed experts "
                        "on GPUs by default for this model and then drops their adapters without a word "
                        "(srt/lora/mem_pool.py:1146); start its server with --disable-shared-experts-fusion")
    return warnings
