"""Mixture-of-experts decoder LMs: Qwen3-MoE, Mixtral.

Attention is Qwen3's (so attention adapters apply as on dense models); the MLP of each
sparse layer is a router plus experts held as fused 3D tensors, the layout the MoE ops
read: gate_up_proj [E, 2I, H] (gate rows, then up rows) and down_proj [E, H, I].
Checkpoints in that layout load directly; per-expert checkpoints
(`mlp.experts.E.gate_proj/up_proj/down_proj`; Mixtral's `block_sparse_moe.experts.E.w1/
w3/w2`) are assembled into it (models/weights.py).

Adapters: the router is a LoRALinear (router LoRA like any projection); each token's
adapter on its routed experts comes from the expert slot tensors that
adapters/slots.py attaches to `Experts` (see ops.MoELoRA for their layout).
"""

from __future__ import annotations

import torch
from torch import nn

from loraplex import ops
from loraplex.config import ModelConfig
from loraplex.layers.context import get_forward_context
from loraplex.layers.linear import LoRALinear
from loraplex.models.blocks import DecoderLayer, GatedMLP
from loraplex.models.dense import DenseCausalLM
from loraplex.ops.metadata import MoELoRA


class Experts(nn.Module):
    def __init__(self, cfg: ModelConfig, bias: bool = False):
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts, self.hidden_size, self.intermediate_size = e, h, i
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h), False)
        self.down_proj = nn.Parameter(torch.empty(e, h, i), False)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i), False) if bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(e, h), False) if bias else None
        # Attached by LoRASlotBuffers: [max_loras, E, R_gu, H], [max_loras, E, 2I, R_gu],
        # [max_loras, E, R_d, I], [max_loras, E, H, R_d]; and the slots whose adapter
        # adapts these experts (a step whose tokens use none of them skips the LoRA path).
        self.lora_a_gate_up = self.lora_b_gate_up = None
        self.lora_a_down = self.lora_b_down = None
        self.lora_slots: set[int] = set()
        self.lora_slot_mask: torch.Tensor | None = None  # the same on the device [max_loras]
        self.lora_ranks: torch.Tensor | None = None  # [2, max_loras]: each slot's gate_up, down rank

    def step_lora(self) -> MoELoRA | None:
        """This step's adapters on these experts, or None when no token has one. A CUDA
        graph is captured before any adapter loads and replayed for any mix: its adapter
        variant always runs the expert LoRA kernels (slots without expert weights are zero)."""
        if self.lora_a_gate_up is None:
            return None
        batch = get_forward_context().lora
        if batch is None or not batch.active:
            return None
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if not capturing and not any(g.slot in self.lora_slots for g in batch.groups):
            return None
        return MoELoRA(self.lora_a_gate_up, self.lora_b_gate_up, self.lora_a_down,
                       self.lora_b_down, batch.token_slot, self.lora_slot_mask, self.lora_ranks)


class SparseMoE(nn.Module):
    """Router (softmax top-k, optionally renormalised) and experts. Returns each token's
    top_k weighted expert outputs unsummed, [T, top_k, H]: the decoder's next residual
    add + RMSNorm sums them in its launch."""

    def __init__(self, cfg: ModelConfig, router_name: str = "gate", bias: bool = False):
        super().__init__()
        # The router is named as in the checkpoint (Qwen3-MoE, Mixtral: `gate`).
        self.router_name = router_name
        setattr(self, router_name, LoRALinear(cfg.hidden_size, [cfg.num_experts], [router_name], bias=bias))
        self.experts = Experts(cfg, bias=bias)
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.activation, self.swiglu_limit = cfg.activation, cfg.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = getattr(self, self.router_name)(x)
        weights, ids = ops.route_experts(logits, self.top_k, self.renormalize)
        e, ctx = self.experts, get_forward_context()
        # [T, top_k, H], unsummed: the next residual add + RMSNorm sums each token's rows.
        return ops.fused_experts(x, weights, ids, e.gate_up_proj, e.down_proj, self.activation,
                                 e.gate_up_proj_bias, e.down_proj_bias, e.step_lora(), self.swiglu_limit,
                                 ctx.moe_stats, ctx.aux_stream, sum_topk=False)

    def warm_up(self, max_tokens: int) -> None:
        """Compile the expert kernels that eager steps of up to max_tokens tokens run."""
        e = self.experts
        lora = None
        if e.lora_a_gate_up is not None:
            lora = MoELoRA(e.lora_a_gate_up, e.lora_b_gate_up, e.lora_a_down, e.lora_b_down,
                           e.lora_slot_mask.new_zeros(0), e.lora_slot_mask, e.lora_ranks)
        ops.warm_up_moe(e.gate_up_proj, e.down_proj, self.top_k, self.renormalize,
                        self.activation, e.gate_up_proj_bias, e.down_proj_bias, lora,
                        self.swiglu_limit, max_tokens)

    def warm_up_key(self) -> tuple:
        """Layers with equal keys compile the same kernel variants."""
        e = self.experts
        return (tuple(e.gate_up_proj.shape), e.gate_up_proj.dtype, e.gate_up_proj_bias is not None,
                e.lora_a_gate_up is not None and tuple(e.lora_a_gate_up.shape), self.top_k,
                self.renormalize, self.activation, self.swiglu_limit)


class MoEDecoderLayer(DecoderLayer):
    def make_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return SparseMoE(cfg) if layer in cfg.moe_layers else GatedMLP(cfg)


class MoECausalLM(DenseCausalLM):
    layer_cls = MoEDecoderLayer


class MixtralCausalLM(MoECausalLM):
    # Mixtral checkpoints call each layer's sparse MLP block_sparse_moe.
    checkpoint_renames = {".block_sparse_moe.": ".mlp."}
