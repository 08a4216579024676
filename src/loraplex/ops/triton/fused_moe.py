"""The MoE MLP from the grouped GEMM kernels: align pairs by expert, gate/up GEMM, down
GEMM, weighted sum over each token's top_k outputs.

Without adapters the activation runs in the gate/up GEMM's epilogue and the routing
weight in the down GEMM's. With adapters (MoELoRA) each delta must land before those,
so the gate/up GEMM stores [P, 2I], the adapter delta is added into it, a separate
kernel applies the activation, and the down GEMM's output gets its delta before the
weighted sum. Those two outputs are float32, as in the reference: rounding the base
output to bf16 and again after adding a delta of similar size doubles the error (bf16
tests: ~4x the reference's own error otherwise).
Every launch reads only device tensors and its grid depends on shapes only (no host
sync: captured and replayed in a CUDA graph on an H100, matching eager bit for bit).
"""

from __future__ import annotations

import torch

from loraplex.ops.metadata import MoELoRA
from loraplex.ops.triton.moe_act import check_activation, moe_act_and_mul
from loraplex.ops.triton.moe_align import align_experts, align_lora
from loraplex.ops.triton.moe_gemm import gemm_config, moe_gemm
from loraplex.ops.triton.moe_lora import lora_block_m, moe_lora


def fused_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    activation: str = "silu",
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    lora: MoELoRA | None = None,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """See loraplex.ops.fused_experts."""
    limit = check_activation(activation, swiglu_limit)
    t, top_k = topk_ids.shape
    num_experts, two_i, hidden = w_gate_up.shape
    assert x.shape == (t, hidden) and w_down.shape == (num_experts, hidden, two_i // 2)
    if t == 0:
        return x.new_empty(0, hidden)
    p, dev = t * top_k, x.device
    cfg_gu, cfg_d = gemm_config(w_gate_up, t, top_k), gemm_config(w_down, t, top_k)
    align_gu = align_experts(topk_ids, num_experts, cfg_gu["BLOCK_M"])
    align_d = (align_gu if cfg_d["BLOCK_M"] == cfg_gu["BLOCK_M"]
               else align_experts(topk_ids, num_experts, cfg_d["BLOCK_M"]))
    weights = topk_weights.float().contiguous()

    if lora is None:
        h = torch.empty(p, two_i // 2, dtype=x.dtype, device=dev)
        moe_gemm(x, w_gate_up, b_gate_up, h, align_gu, cfg_gu, top_k, activation, limit)
        y = torch.empty(p, hidden, dtype=x.dtype, device=dev)
        moe_gemm(h, w_down, b_down, y, align_d, cfg_d, 1, routed_weights=weights)
        return y.view(t, top_k, hidden).sum(1)

    align_l = align_lora(topk_ids, lora.token_slot, num_experts, lora.a_gate_up.shape[0],
                         lora_block_m(p), lora.slot_mask)
    gate_up = torch.empty(p, two_i, dtype=torch.float32, device=dev)
    moe_gemm(x, w_gate_up, b_gate_up, gate_up, align_gu, cfg_gu, top_k)
    moe_lora(x, lora.a_gate_up, lora.b_gate_up, gate_up, align_l, top_k)
    h = moe_act_and_mul(gate_up, activation, swiglu_limit, x.dtype)
    y = torch.empty(p, hidden, dtype=torch.float32, device=dev)
    moe_gemm(h, w_down, b_down, y, align_d, cfg_d, 1)
    moe_lora(h, lora.a_down, lora.b_down, y, align_l, 1)
    return (y.view(t, top_k, hidden) * weights[..., None]).sum(1).to(x.dtype)
