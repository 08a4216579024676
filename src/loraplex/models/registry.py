"""The one table of supported architectures: Hugging Face architecture name -> the model
class and the facts its config does not say.

Adding a dense family is a row here (a model file only if its block differs from the
shared ones) and an entry in the parity tests' list of architectures.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from loraplex.config import ArchitectureFacts, ModelConfig
from loraplex.errors import UnsupportedModel
from loraplex.models.deepseek_v2 import DeepseekV2CausalLM
from loraplex.models.dense import DenseCausalLM
from loraplex.models.gemma3 import Gemma3CausalLM
from loraplex.models.gpt_oss import GptOssCausalLM
from loraplex.models.moe import MixtralCausalLM, MoECausalLM


@dataclass(frozen=True)
class Architecture:
    model: type[nn.Module]
    facts: ArchitectureFacts


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(DenseCausalLM, ArchitectureFacts(qk_norm=False)),
    "MistralForCausalLM": Architecture(DenseCausalLM, ArchitectureFacts(
        qk_norm=False, qkv_bias=False, o_bias=False)),
    "Qwen2ForCausalLM": Architecture(DenseCausalLM, ArchitectureFacts(
        qk_norm=False, qkv_bias=True, o_bias=False)),
    "Qwen3ForCausalLM": Architecture(DenseCausalLM, ArchitectureFacts(qk_norm=True)),
    # Gemma 3: (1 + w) norms, four per block, GELU-tanh, scaled embeddings, q/k norm,
    # interleaved sliding-window and global layers with their own rope bases.
    "Gemma3ForCausalLM": Architecture(Gemma3CausalLM, ArchitectureFacts(qk_norm=True, gemma=True)),
    # Qwen3's attention; sparse MoE MLPs (softmax router, top-k, optional renormalisation).
    "Qwen3MoeForCausalLM": Architecture(MoECausalLM, ArchitectureFacts(qk_norm=True, moe=True)),
    # Mistral's attention; every MLP sparse, top-2 always renormalised.
    "MixtralForCausalLM": Architecture(MixtralCausalLM, ArchitectureFacts(
        qk_norm=False, qkv_bias=False, o_bias=False, moe=True, norm_topk_prob=True)),
    # gpt-oss: biased attention with per-head sinks, alternating sliding/full layers, YaRN;
    # every MLP sparse, biased router and experts, softmax over the top-k logits (=
    # renormalised top-k), clamped SwiGLU (hidden_act says "silu" but is unused);
    # transformers 5.17 hard-codes the clamp at 7 and saves none.
    "GptOssForCausalLM": Architecture(GptOssCausalLM, ArchitectureFacts(
        qk_norm=False, moe=True, norm_topk_prob=True, activation="swiglu_oai", sinks=True,
        swiglu_limit=7.0)),
    # DeepSeek-V2: multi-head latent attention; dense first layers, then sparse MLPs with
    # shared experts (softmax router, greedy top-k, not renormalised unless it says so).
    "DeepseekV2ForCausalLM": Architecture(DeepseekV2CausalLM, ArchitectureFacts(
        qk_norm=False, qkv_bias=False, o_bias=False, moe=True, mla=True, renormalize=False)),
    # DeepSeek-V3: V2's blocks; sigmoid routing with a correction bias within expert groups.
    "DeepseekV3ForCausalLM": Architecture(DeepseekV2CausalLM, ArchitectureFacts(
        qk_norm=False, qkv_bias=False, o_bias=False, moe=True, mla=True, topk_method="noaux_tc")),
}


def model_config(hf) -> ModelConfig:
    """The ModelConfig of a transformers PretrainedConfig of a supported architecture."""
    names = getattr(hf, "architectures", None) or []
    name = next((a for a in names if a in ARCHITECTURES), None)
    if name is None:
        raise UnsupportedModel(f"architecture {names or hf.model_type!r} is not supported; "
                               f"supported: {', '.join(ARCHITECTURES)}")
    return ModelConfig.from_hf(hf, name, ARCHITECTURES[name].facts)


def build_model(cfg: ModelConfig, max_positions: int) -> nn.Module:
    return ARCHITECTURES[cfg.architecture].model(cfg, max_positions)
