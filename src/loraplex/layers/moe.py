"""The mixture-of-experts MLP layer: a router and experts held as fused 3D tensors.

The layout is the one the MoE ops read: gate_up_proj [E, 2I, H] (gate rows, then up
rows) and down_proj [E, H, I]. The router is a LoRALinear (router LoRA like any
projection); each token's adapter on its routed experts comes from the experts' slots
(`Experts.lora`, an ExpertLoRAWeights that adapters/slots.py allocates and fills).
"""

from __future__ import annotations

import torch
from torch import nn

from loraplex import ops
from loraplex.config import ModelConfig
from loraplex.layers.context import get_forward_context
from loraplex.layers.linear import LoRALinear, weight_device
from loraplex.layers.lora_weights import ExpertLoRAWeights
from loraplex.layers.parallel import ExpertShard, reduce_deferred
from loraplex.ops.formats import Fp8Rows
from loraplex.ops.metadata import MoELoRA

# Greedy routing without router LoRA through ops.route_tokens (logits and routing in one
# op, one kernel in decode steps); False: the router's projection, then route_experts
# (benchmarks: decode_breakdown --router-gemm).
ROUTE_IN_ONE_OP = True


class Experts(nn.Module):
    def __init__(self, cfg: ModelConfig, bias: bool = False):
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts, self.hidden_size, self.intermediate_size = e, h, i
        # Tensors, or quantized weights (ops/formats) of these shapes.
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h, device=weight_device()), False)
        self.down_proj = nn.Parameter(torch.empty(e, h, i, device=weight_device()), False)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i), False) if bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(e, h), False) if bias else None
        self.lora: ExpertLoRAWeights | None = None  # None: this engine serves no adapters
        self.tp: ExpertShard | None = None  # tensor parallel: the intermediate rows held here

    def step_lora(self) -> MoELoRA | None:
        """This step's adapters on these experts, or None when no token has one. A CUDA
        graph is captured before any adapter loads and replayed for any mix: its adapter
        variant always runs the expert LoRA kernels (slots without expert weights are zero)."""
        w = self.lora
        batch = get_forward_context().lora
        if w is None or batch is None or not batch.active:
            return None
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if not capturing and not any(g.slot in w.slots for g in batch.groups):
            return None
        return self._moe_lora(batch.token_slot)

    def _moe_lora(self, token_slot: torch.Tensor) -> MoELoRA:
        w = self.lora
        return MoELoRA(w.a_gate_up, w.b_gate_up, w.a_down, w.b_down, token_slot, w.slot_mask, w.ranks)


class SparseMoE(nn.Module):
    """Router (softmax top-k, optionally renormalised) and experts. Returns each token's
    top_k weighted expert outputs unsummed, [T, top_k, H]: the decoder's next residual
    add + RMSNorm sums them in its launch. Under tensor parallelism each rank's outputs
    are partial sums: summed here, then all-reduced ([T, H], not top_k times that)."""

    def __init__(self, cfg: ModelConfig, router_name: str = "gate", bias: bool = False):
        super().__init__()
        # The router is named as in the checkpoint (Qwen3-MoE, Mixtral: `gate`).
        self.router_name = router_name
        router = LoRALinear(cfg.hidden_size, [cfg.num_experts], [router_name], bias=bias)
        router.is_router = True
        setattr(self, router_name, router)
        self.experts = Experts(cfg, bias=bias)
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.routed_scale = cfg.routed_scaling_factor  # DeepSeek: the routed weights times this
        self.routing = (cfg.topk_method, cfg.num_expert_groups, cfg.topk_group)
        if cfg.topk_method == "noaux_tc":  # DeepSeek-V3: the router's bias on the choice (float32)
            router = getattr(self, router_name)
            router.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts, dtype=torch.float32),
                                                          False)
        self.activation, self.swiglu_limit = cfg.activation, cfg.swiglu_limit

    def fp8_input_block(self, tokens: int) -> int:
        """The block of e4m3 rows W8A8 experts read x in (LoRALinear.fp8_input_block; the
        router reads x as it is)."""
        return ops.fp8_input_block([self.experts.gate_up_proj], tokens)

    def forward(self, x: torch.Tensor, x_fp8: Fp8Rows | None = None) -> torch.Tensor:
        router = getattr(self, self.router_name)
        greedy = self.routing[0] == "greedy"
        if greedy and ROUTE_IN_ONE_OP and router.tp is None and router.lora_batch() is None:
            # No LoRA on the router this step: its logits and their routing in one op.
            weights, ids = ops.route_tokens(x, router.weight, router.bias, self.top_k, self.renormalize)
        elif greedy:
            weights, ids = ops.route_experts(router(x), self.top_k, self.renormalize)
        else:
            logits = router(x)
            bias = getattr(router, "e_score_correction_bias", None)
            weights, ids = ops.route_experts_grouped(logits, self.top_k, *self.routing, self.renormalize,
                                                     bias)
        if self.routed_scale != 1.0:
            weights = weights * self.routed_scale
        e, ctx = self.experts, get_forward_context()
        # [T, top_k, H], unsummed: the next residual add + RMSNorm sums each token's rows.
        out = ops.fused_experts(x, weights, ids, e.gate_up_proj, e.down_proj, self.activation,
                                e.gate_up_proj_bias, e.down_proj_bias, e.step_lora(), self.swiglu_limit,
                                ctx.moe_stats, ctx.aux_stream, sum_topk=e.tp is not None, x_fp8=x_fp8)
        return out if e.tp is None or reduce_deferred() else e.tp.group.all_reduce(out)

    def warm_up(self, max_tokens: int) -> None:
        """Compile the expert kernels that eager steps of up to max_tokens tokens run."""
        e = self.experts
        lora = e._moe_lora(e.lora.slot_mask.new_zeros(0)) if e.lora is not None else None
        ops.warm_up_moe(e.gate_up_proj, e.down_proj, self.top_k, self.renormalize,
                        self.activation, e.gate_up_proj_bias, e.down_proj_bias, lora,
                        self.swiglu_limit, max_tokens)

    def warm_up_key(self) -> tuple:
        """Layers with equal keys compile the same kernel variants."""
        e = self.experts
        return (tuple(e.gate_up_proj.shape), e.gate_up_proj.dtype, type(e.gate_up_proj).__name__,
                getattr(e.gate_up_proj, "block_k", None), e.gate_up_proj_bias is not None,
                e.lora is not None and tuple(e.lora.a_gate_up.shape), self.top_k,
                self.renormalize, self.activation, self.swiglu_limit)
