"""Gated activations of the MoE experts: act(gate) * up, in float32, applied by the
gate/up GEMM in its epilogue (after any adapter delta), or by `gated_act_rows` to the
GEMM's float32 sums where the delta is added after it (fused_moe.py: decode steps with
adapters on W8A8 experts, whose gate/up delta kernel runs beside the GEMM). Constants as
in reference/moe.py.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from loraplex.ops.reference.moe import SWIGLU_OAI_ALPHA
from loraplex.ops.triton.launch import pdl, wait_for_inputs

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


@triton.jit
def _gated_act_rows_kernel(
    sums_ptr, delta_ptr, out_ptr, N, limit, stride_sm, stride_dm, stride_om,
    ACTIVATION: tl.constexpr, ALPHA: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = None if EVEN_N else n < N
    sums, delta = sums_ptr + row * stride_sm + n, delta_ptr + row * stride_dm + n
    gate = tl.load(sums, mask=mask) + tl.load(delta, mask=mask)
    up = tl.load(sums + N, mask=mask) + tl.load(delta + N, mask=mask)
    out = gated_act(gate, up, limit, ACTIVATION, ALPHA)
    tl.store(out_ptr + row * stride_om + n, out.to(out_ptr.dtype.element_ty), mask=mask)


def gated_act_rows(sums: torch.Tensor, delta: torch.Tensor, out: torch.Tensor, activation: str,
                   limit: float) -> None:
    """out [P, N] = act(gate) * up with gate, up = sums + delta at columns [:N] and [N:]:
    the gate/up GEMM's float32 sums (bias included) and the adapter delta, float32
    [P, 2N] both; one rounding to out's dtype, as the GEMM's own epilogue does."""
    p, n = out.shape
    assert sums.shape == delta.shape == (p, 2 * n) and sums.dtype == delta.dtype == torch.float32
    assert sums.stride(1) == delta.stride(1) == out.stride(1) == 1
    if p == 0:
        return
    block_n = min(1024, triton.next_power_of_2(n))
    _gated_act_rows_kernel[(p, triton.cdiv(n, block_n))](
        sums, delta, out, n, limit, sums.stride(0), delta.stride(0), out.stride(0),
        ACTIVATION=activation, ALPHA=SWIGLU_OAI_ALPHA, BLOCK_N=block_n, EVEN_N=n % block_n == 0, num_warps=4,
        **pdl(),
    )
