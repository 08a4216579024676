"""Mixture-of-experts decoder LMs: Qwen3-MoE, Mixtral.

Attention is Qwen3's (so attention adapters apply as on dense models); the MLP of each
sparse layer is layers/moe.py's SparseMoE (a router and experts as fused 3D tensors).
Checkpoints in that layout load directly; per-expert checkpoints
(`mlp.experts.E.gate_proj/up_proj/down_proj`; Mixtral's `block_sparse_moe.experts.E.w1/
w3/w2`) are assembled into it (models/weights.py).
"""

from __future__ import annotations

from torch import nn

from loraplex.config import ModelConfig
from loraplex.layers.moe import SparseMoE
from loraplex.models.blocks import DecoderLayer, GatedMLP
from loraplex.models.dense import DenseCausalLM


class MoEDecoderLayer(DecoderLayer):
    def make_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return SparseMoE(cfg) if layer in cfg.moe_layers else GatedMLP(cfg)


class MoECausalLM(DenseCausalLM):
    layer_cls = MoEDecoderLayer
    # --quantization fp8 leaves the routers in the model's dtype, as the published FP8
    # checkpoints (Qwen3-30B-A3B-FP8) keep them and vLLM builds them (routing is
    # sensitive, and a [E, H] router is a few hundred KB).
    unquantized_modules = ("gate",)


class MixtralCausalLM(MoECausalLM):
    # Mixtral checkpoints call each layer's sparse MLP block_sparse_moe.
    checkpoint_renames = {".block_sparse_moe.": ".mlp."}
