"""SiLU-and-multiply of the fused gate/up projection: out = silu(x[:, :I]) * x[:, I:]."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, width, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    rows, width = x.shape
    size = width // 2
    assert x.stride(-1) == 1
    out = torch.empty(rows, size, dtype=x.dtype, device=x.device)
    block = 1024
    _silu_and_mul_kernel[(rows, triton.cdiv(size, block))](
        x, out, size, x.stride(0), out.stride(0), BLOCK=block, num_warps=4
    )
    return out
