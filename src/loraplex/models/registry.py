"""Hugging Face architecture name -> model class."""

from __future__ import annotations

from torch import nn

from loraplex.config import SUPPORTED_ARCHITECTURES, ModelConfig
from loraplex.errors import UnsupportedModel
from loraplex.models.dense import DenseCausalLM
from loraplex.models.gemma3 import Gemma3CausalLM
from loraplex.models.gpt_oss import GptOssCausalLM
from loraplex.models.moe import MixtralCausalLM, MoECausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": DenseCausalLM,
    "MistralForCausalLM": DenseCausalLM,
    "Qwen2ForCausalLM": DenseCausalLM,
    "Qwen3ForCausalLM": DenseCausalLM,
    "Qwen3MoeForCausalLM": MoECausalLM,
    "MixtralForCausalLM": MixtralCausalLM,
    "Gemma3ForCausalLM": Gemma3CausalLM,
    "GptOssForCausalLM": GptOssCausalLM,
}
assert set(_MODELS) == set(SUPPORTED_ARCHITECTURES)


def build_model(cfg: ModelConfig, max_positions: int) -> nn.Module:
    cls = _MODELS.get(cfg.architecture)
    if cls is None:
        raise UnsupportedModel(f"no model class for {cfg.architecture}; known: {', '.join(_MODELS)}")
    return cls(cfg, max_positions)
