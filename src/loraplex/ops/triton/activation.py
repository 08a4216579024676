"""Gated activations of the fused gate/up projection: out = act(x[:, :I]) * x[:, I:],
act = SiLU (Llama, Qwen, Mistral) or tanh-approximated GELU (Gemma), in float32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.ops.triton.launch import pdl, wait_for_inputs


@triton.jit
def gated_act(gate, GELU: tl.constexpr):
    """act(gate) in float32: SiLU, or tanh GELU when GELU."""
    if GELU:  # 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), tanh(u) = 2 sigmoid(2u) - 1
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        return gate / (1.0 + tl.exp(-2.0 * inner))
    return gate / (1.0 + tl.exp(-gate))


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, width, stride_x, stride_o,
                       GELU: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=mask, other=0.0).to(tl.float32)
    act = gated_act(gate, GELU)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def _act_and_mul(x: torch.Tensor, gelu: bool) -> torch.Tensor:
    rows, width = x.shape
    size = width // 2
    assert x.stride(-1) == 1
    out = torch.empty(rows, size, dtype=x.dtype, device=x.device)
    block = 1024
    _act_and_mul_kernel[(rows, triton.cdiv(size, block))](
        x, out, size, x.stride(0), out.stride(0), GELU=gelu, BLOCK=block, num_warps=4, **pdl()
    )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _act_and_mul(x, gelu=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _act_and_mul(x, gelu=True)
