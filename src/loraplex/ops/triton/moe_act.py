"""Gated activations of the MoE experts: act(gate) * up, in float32.

`gated_act` is shared: the gate/up GEMM applies it in its epilogue (no adapters), and
`moe_act_and_mul` applies it to a stored [P, 2I] gate/up output when an adapter delta
had to be added before the activation. Constants as in reference/moe.py.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from loraplex.ops.reference.moe import SWIGLU_OAI_ALPHA

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


@triton.jit(do_not_specialize=["width", "limit"])
def _moe_act_kernel(x_ptr, out_ptr, width, limit, stride_x, stride_o,
                    ACTIVATION: tl.constexpr, ALPHA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=mask, other=0.0).to(tl.float32)
    out = gated_act(gate, up, limit, ACTIVATION, ALPHA)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def moe_act_and_mul(x: torch.Tensor, activation: str, swiglu_limit: float | None,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [P, 2I] (gate columns, then up columns) -> [P, I] in out_dtype (default x's)."""
    limit = check_activation(activation, swiglu_limit)
    rows, width = x.shape[0], x.shape[1] // 2
    assert x.stride(-1) == 1
    out = torch.empty(rows, width, dtype=out_dtype or x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(width))
    if rows:
        _moe_act_kernel[(rows, triton.cdiv(width, block))](
            x, out, width, limit, x.stride(0), out.stride(0),
            ACTIVATION=activation, ALPHA=SWIGLU_OAI_ALPHA, BLOCK=block, num_warps=4,
        )
    return out
