"""RMSNorm, optionally fused with the residual add that precedes it.

One program per row. With a residual, the sum x + residual is rounded to the model dtype
(as the unfused model computes it), stored as the new residual stream, and normalised in
float32; the normalised row is rounded before the weight multiplies it, as in Hugging
Face's Llama RMSNorm, or (UNIT_OFFSET, Gemma) scaled by 1 + weight in float32 and then
rounded. Rows may be (token, head) pairs of a strided [T, H, D] view (q/k norm). With a
residual, x may be [T, K, N]: a MoE block's K expert outputs per token, summed here (one
launch and one pass over them less than a separate sum).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def scale_normed(x, w, dtype, UNIT_OFFSET: tl.constexpr):
    """x * rstd (float32) times the norm weight, rounded as the model rounds it: Llama
    rounds to `dtype` first, Gemma (UNIT_OFFSET) scales by 1 + w in float32. The result
    is float32, still to be rounded. Shared with the rotary kernel's q/k norm."""
    if UNIT_OFFSET:
        return x * (1.0 + w)
    return x.to(dtype).to(tl.float32) * w


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    N, eps,
    stride_x0, stride_x1, stride_r0, stride_o0, stride_o1,
    INNER: tl.constexpr, HAS_RESIDUAL: tl.constexpr, UNIT_OFFSET: tl.constexpr,
    SUM_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0)
    outer, inner = row // INNER, row % INNER
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    x = tl.load(x_ptr + outer * stride_x0 + inner * stride_x1 + offs, mask=mask, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    if SUM_ROWS > 1:  # x [T, SUM_ROWS, N] (INNER 1): the row's terms, summed and rounded
        for j in tl.static_range(1, SUM_ROWS):
            term = tl.load(x_ptr + outer * stride_x0 + j * stride_x1 + offs, mask=mask, other=0.0)
            x += term.to(tl.float32)
        x = x.to(dtype).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r0 + offs, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(dtype)
        tl.store(res_out_ptr + row * stride_r0 + offs, x, mask=mask)
        x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = scale_normed(x * rstd, w, dtype, UNIT_OFFSET)
    tl.store(out_ptr + outer * stride_o0 + inner * stride_o1 + offs, y.to(dtype), mask=mask)



def _launch(x, residual, weight, eps, unit_offset):
    n = x.shape[-1]
    assert x.stride(-1) == 1 and weight.shape == (n,), (x.stride(), weight.shape)
    x3 = x if x.dim() == 3 else x.unsqueeze(1)  # [outer, inner, N]
    # With a residual, a 3-D x holds terms to sum per row; without, rows of heads to norm.
    sum_rows = x3.shape[1] if residual is not None else 1
    out_shape = (x3.shape[0], 1 if sum_rows > 1 else x3.shape[1], n)
    out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(residual) if residual is not None else None
    if residual is not None:
        assert residual.shape == (x3.shape[0], n) and residual.stride(-1) == 1, (x.shape, residual.shape)
    rows = out_shape[0] * out_shape[1]
    _rms_norm_kernel[(rows,)](
        x3, residual if residual is not None else x3, weight, out,
        res_out if res_out is not None else out,
        n, eps,
        x3.stride(0), x3.stride(1),
        residual.stride(0) if residual is not None else 0,
        out.stride(0), out.stride(1),
        INNER=out_shape[1], HAS_RESIDUAL=residual is not None, UNIT_OFFSET=unit_offset,
        SUM_ROWS=sum_rows, BLOCK_N=triton.next_power_of_2(n),
        num_warps=4 if n <= 4096 else 8,
    )
    return out.view(x.shape if residual is None else residual.shape), res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False):
    return _launch(x, None, weight, eps, unit_offset)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(x, residual, weight, eps, unit_offset)
