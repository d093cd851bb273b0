"""GLM-4.5 checkpoints <-> mop: not written yet (issue 28)."""

from __future__ import annotations

from mop.models.config import ModelConfig

ARCHITECTURE = "Glm4MoeForCausalLM"


def _not_yet(*_) -> None:
    raise NotImplementedError("glm4_moe's Hugging Face mapping is not written yet (issue 28)")


def config_from_hf(hf: dict) -> ModelConfig:
    _not_yet()


config_to_hf = inexpressible = block_pieces = config_from_hf
