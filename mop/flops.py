"""Model FLOPs and MFU: the work a training step must do, whatever the layout or the recomputation.

Per trained token (forward + backward = 3 x forward, multiply-add = 2 FLOPs):
- matmuls: 6 x the parameters one token is multiplied with: per layer the attention projections
  (q, k, v, o), the router, the k routed experts (3 H I each) or the dense MLP, the shared expert;
  plus the output projection. The embedding lookup is no matmul and counts nothing.
- attention scores and values: per layer 2 matmuls of head_dim x the keys the query attends, for
  every query head, x 2 FLOPs x 3 (forward + backward). Convention: causal attention counts the
  keys a query really attends (`attended_keys`: its position in its document + 1, so (S + 1) / 2
  on average for one document of S tokens, less with packed documents), not the full S that some
  reports count.
Activation-checkpointing recomputation, LLEP's extra chunk work and the vocabulary ring's
recomputed logits are not model FLOPs: MFU is model FLOPs / step time / peak.

Peak: bf16 dense tensor-core FLOP/s of the device, from its name (H100 / H200 SXM 989e12, their
PCIe / NVL cards less, A100 312e12); unknown devices give no MFU.
"""

from __future__ import annotations

import torch

from mop.models.config import ModelConfig

# bf16 dense peaks by device name, most specific first: the PCIe and NVL cards run lower clocks.
PEAK_BF16_FLOPS = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H200 NVL": 835e12, "H100": 989e12, "H200": 989e12,
                   "A100": 312e12}


def matmul_params_per_token(cfg: ModelConfig) -> int:
    """Parameters each token is multiplied with once in a forward (see the module docstring)."""
    h = cfg.hidden
    attention = h * cfg.head_dim * (2 * cfg.heads + 2 * cfg.kv_heads)
    moe = h * cfg.experts + cfg.top_k * 3 * h * cfg.expert_intermediate + 3 * h * cfg.shared_expert_intermediate
    dense = 3 * h * cfg.dense_intermediate
    layers = cfg.layers * attention + cfg.dense_layers * dense + (cfg.layers - cfg.dense_layers) * moe
    return layers + h * cfg.vocab_size


def flops_per_token(cfg: ModelConfig, attended_keys: float) -> float:
    """Model FLOPs of training one token that attends `attended_keys` keys on average (causal)."""
    attention = cfg.layers * cfg.heads * cfg.head_dim * attended_keys * 2 * 2 * 3
    return 6 * matmul_params_per_token(cfg) + attention


def attended_keys(position_ids: torch.Tensor) -> torch.Tensor:
    """The keys each token attends causally: its position in its document + 1 (positions restart
    at every document, and under sequence parallelism they are the global ones)."""
    return position_ids + 1


def peak_flops(device: torch.device) -> float | None:
    """The device's bf16 dense peak FLOP/s, when its name is known (CUDA only)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)
