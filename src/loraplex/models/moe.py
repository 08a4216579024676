"""Mixture-of-experts decoder LMs: Qwen3-MoE, Mixtral.

Attention is Qwen3's (so attention adapters apply as on dense models); the MLP of each
sparse layer is a router plus experts held as fused 3D tensors, the layout the MoE ops
read: gate_up_proj [E, 2I, H] (gate rows, then up rows) and down_proj [E, H, I].
Checkpoints in that layout load directly; per-expert checkpoints
(`mlp.experts.E.gate_proj/up_proj/down_proj`; Mixtral's `block_sparse_moe.experts.E.w1/
w3/w2`) are assembled into it (models/weights.py).
Adapters on experts are not served yet: their keys fail as modules this model cannot
adapt.
"""

from __future__ import annotations

import torch
from torch import nn

from loraplex import ops
from loraplex.config import ModelConfig
from loraplex.models.blocks import DecoderLayer, GatedMLP
from loraplex.models.dense import DenseCausalLM


class Experts(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h), False)
        self.down_proj = nn.Parameter(torch.empty(e, h, i), False)


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        self.gate.weight.requires_grad_(False)
        self.experts = Experts(cfg)
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.activation = cfg.activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.fused_moe(x, self.gate.weight, self.experts.gate_up_proj, self.experts.down_proj,
                             self.top_k, self.renormalize, self.activation)


class MoEDecoderLayer(DecoderLayer):
    def make_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return SparseMoE(cfg) if layer in cfg.moe_layers else GatedMLP(cfg)


class MoECausalLM(DenseCausalLM):
    layer_cls = MoEDecoderLayer


class MixtralCausalLM(MoECausalLM):
    # Mixtral checkpoints call each layer's sparse MLP block_sparse_moe.
    checkpoint_renames = {".block_sparse_moe.": ".mlp."}
