"""Mixture-of-experts MLP, plain torch: route, then run each hit expert on its tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_moe(
    x: torch.Tensor,
    router: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    top_k: int,
    renormalize: bool,
    activation: str = "silu",
) -> torch.Tensor:
    """x [T, H]; router [E, H]; w_gate_up [E, 2I, H] (gate rows, then up rows);
    w_down [E, H, I]. Softmax over all experts (float32), the top_k per token, optionally
    renormalised to sum to 1; out = sum_k p_k * down_e(act(gate_e(x)) * up_e(x))."""
    probs = F.linear(x, router).float().softmax(-1)
    weights, experts = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    weights = weights.to(x.dtype)
    act = {"silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[activation]
    out = torch.zeros_like(x)
    for e in experts.unique().tolist():
        tok, k = torch.where(experts == e)
        gate, up = F.linear(x[tok], w_gate_up[e]).chunk(2, dim=-1)
        y = F.linear(act(gate) * up, w_down[e]) * weights[tok, k, None]
        out.index_add_(0, tok, y)
    return out
