"""Gated activations of the MoE experts: act(gate) * up, in float32, applied by the
gate/up GEMM in its epilogue (after any adapter delta). Constants as in reference/moe.py.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_oai")


@triton.jit
def gated_act(gate, up, limit, ACTIVATION: tl.constexpr, ALPHA: tl.constexpr):
    """gate, up float32 tiles; limit: the swiglu_oai clamp (inf for none)."""
    if ACTIVATION == "silu":
        out = gate / (1.0 + tl.exp(-gate)) * up
    elif ACTIVATION == "gelu_tanh":  # 0.5 g (1 + tanh(u)) = g * sigmoid(2u)
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        out = gate / (1.0 + tl.exp(-2.0 * inner)) * up
    else:  # swiglu_oai (gpt-oss): clamped gate and up, g * sigmoid(alpha g) * (u + 1)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        out = gate / (1.0 + tl.exp(-ALPHA * gate)) * (up + 1.0)
    return out


def check_activation(activation: str, swiglu_limit: float | None) -> float:
    """The limit argument of gated_act."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown MoE activation {activation!r}")
    return math.inf if swiglu_limit is None else float(swiglu_limit)
