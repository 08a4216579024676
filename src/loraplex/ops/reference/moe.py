"""Mixture-of-experts MLP, plain torch: route, then run each hit expert on its tokens,
with each token's own adapter on its routed experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraplex.ops.metadata import MoELoRA
from loraplex.ops.reference.quant import dequantize, dequantized_activations, fp8_values, w8a8

SWIGLU_OAI_ALPHA = 1.702  # gpt-oss: glu = gate * sigmoid(alpha * gate)


def route_experts(logits: torch.Tensor, top_k: int, renormalize: bool):
    """Softmax over all experts (float32), the top_k per token, optionally renormalised
    to sum to 1 (equal to a softmax over the top_k logits: gpt-oss). Returns (weights
    float32 [T, k], expert ids int32 [T, k])."""
    probs = logits.float().softmax(-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids.to(torch.int32)


def route_tokens(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int,
                 renormalize: bool):
    """The router's logits, x W^T + b in x's dtype, then route_experts."""
    return route_experts(F.linear(x, weight, bias), top_k, renormalize)


def apply_activation(gate_up: torch.Tensor, activation: str, swiglu_limit: float | None = None):
    """gate_up [..., 2I] (gate columns, then up columns) -> [..., I], in float32."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    if activation == "swiglu_oai":  # gpt-oss: clamped, (up + 1)
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(-swiglu_limit, swiglu_limit)
        return gate * torch.sigmoid(SWIGLU_OAI_ALPHA * gate) * (up + 1)
    raise ValueError(f"unknown MoE activation {activation!r}")


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
    routing_stats: torch.Tensor | None = None,
    side_stream: torch.cuda.Stream | None = None,
    sum_topk: bool = True,
    x_fp8=None,
) -> torch.Tensor:
    """See loraplex.ops.fused_experts. Per expert, its (token, k) pairs in one matmul;
    the adapter delta per (slot, expert) group of those pairs. One stream; x quantized
    here, from x (x_fp8, the same rows, is for kernels)."""
    # W8A8 experts (in steps of act_min_tokens or more): each GEMM's input quantized per row
    # (x, then h), e4m3 products in float32.
    t, k = topk_ids.shape
    act_gu, act_d = (w.act_block if w8a8(w, t) else 0 for w in (w_gate_up, w_down))
    w_gate_up, w_down = (w if isinstance(w, torch.Tensor) else fp8_values(w) if w8a8(w, t) else dequantize(w)
                         for w in (w_gate_up, w_down))
    x_gu = dequantized_activations(x, act_gu) if act_gu else x
    if routing_stats is not None:
        hit = torch.zeros(w_gate_up.shape[0], dtype=torch.float32, device=x.device)
        hit[topk_ids.flatten().long()] = 1.0
        routing_stats += torch.stack([hit.sum(), hit.new_ones(())])
    # The sum in float32, rounded once; or each term rounded on its own (sum_topk=False).
    out = (torch.zeros(t, w_down.shape[1], dtype=torch.float32, device=x.device) if sum_topk
           else torch.zeros(t, k, w_down.shape[1], dtype=x.dtype, device=x.device))
    slot = lora.token_slot[:t].long() if lora is not None else None
    for e in topk_ids.unique().tolist():
        tok, j = torch.where(topk_ids == e)
        xe = x[tok]
        gate_up = _expert_linear(x_gu[tok], w_gate_up[e], None if b_gate_up is None else b_gate_up[e])
        if lora is not None:
            gate_up += _lora_delta(xe, slot[tok], lora.a_gate_up[:, e], lora.b_gate_up[:, e])
        h = apply_activation(gate_up, activation, swiglu_limit).to(x.dtype)
        h_d = dequantized_activations(h, act_d) if act_d else h
        y = _expert_linear(h_d, w_down[e], None if b_down is None else b_down[e])
        if lora is not None:
            y += _lora_delta(h, slot[tok], lora.a_down[:, e], lora.b_down[:, e])
        y = y * topk_weights[tok, j, None].float()
        if sum_topk:
            out.index_add_(0, tok, y)
        else:
            out[tok, j] = y.to(x.dtype)
    return out.to(x.dtype)


def _expert_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """float32 x @ w.T + bias: in x's dtype as the weight-only GEMM, or in float32 (W8A8:
    x and w are float32 values of e4m3 operands)."""
    return F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype)).float()


def _lora_delta(x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor):
    """sum over rows of x: x @ a[slot].T @ b[slot].T in float32; slot -1 adds nothing.
    a [L, R, in], b [L, out, R] (zero past each adapter's rank)."""
    delta = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float32, device=x.device)
    for s in slots.unique().tolist():
        if s < 0:
            continue
        rows = slots == s
        delta[rows] = (x[rows].float() @ a[s].float().T) @ b[s].float().T
    return delta


def route_experts_grouped(logits: torch.Tensor, top_k: int, method: str, num_groups: int, topk_group: int,
                          renormalize: bool, correction_bias: torch.Tensor | None = None):
    t, e = logits.shape
    if method == "noaux_tc":
        probs = logits.float().sigmoid()
        choice = probs + correction_bias.float() if correction_bias is not None else probs
        group_scores = choice.view(t, num_groups, -1).topk(2, dim=-1).values.sum(-1)
    else:
        probs = logits.float().softmax(-1)
        choice = probs
        group_scores = choice.view(t, num_groups, -1).amax(-1)
    groups = group_scores.topk(topk_group, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
    keep = keep[:, :, None].expand(t, num_groups, e // num_groups).reshape(t, e)
    fill = float("-inf") if method == "noaux_tc" else 0.0
    ids = choice.masked_fill(~keep, fill).topk(top_k, dim=-1).indices
    weights = probs.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights, ids
