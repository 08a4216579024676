"""Rotary position embedding for training (NeoX half split), forward and backward.

transformers applies RoPE as ~6 elementwise ops per tensor (x * cos, the halves sliced,
negated and concatenated, times sin, the sum) and as many again backward: at 16K tokens
of Qwen3-30B-A3B's 32 query heads, ~2 ms a layer of passes over [B, H, S, D]. Here one
pass each way: a program rotates BLOCK_S positions of one (batch, head), pairs (i, i + D/2)
computed in float32 and rounded once. Any strides for x (a transposed [B, S, H, D] view
stays in that layout: y has x's strides, which keeps SDPA's output in [B, S, H, D] too);
cos / sin [B or 1, S, D] as transformers' rotary embedding makes them.
Backward is the transposed rotation of the gradient (ops.rope_train_backward).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.ops.triton.launch import pdl, wait_for_inputs
from loraplex.ops.triton.precision import INTERPRETED
from loraplex.ops.triton.quant_tiles import operand


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, y_ptr, S, H,
    stride_xb, stride_xh, stride_xs, stride_yb, stride_yh, stride_ys, stride_cb, stride_cs,
    HALF: tl.constexpr, BACKWARD: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    mask = (s < S)[:, None] & (d < HALF)[None, :]
    x = x_ptr + b * stride_xb + h * stride_xh + s[:, None] * stride_xs + d[None, :]
    c = cos_ptr + b * stride_cb + s[:, None] * stride_cs + d[None, :]
    sn = sin_ptr + b * stride_cb + s[:, None] * stride_cs + d[None, :]
    x1 = tl.load(x, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x + HALF, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(c, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(c + HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sn, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sn + HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:  # dx = g cos + rotate_half^T(g sin)
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:  # y = x cos + rotate_half(x) sin
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    y = y_ptr + b * stride_yb + h * stride_yh + s[:, None] * stride_ys + d[None, :]
    dtype = y_ptr.dtype.element_ty
    tl.store(y, operand(y1, y_ptr, UPCAST).to(dtype), mask=mask)
    tl.store(y + HALF, operand(y2, y_ptr, UPCAST).to(dtype), mask=mask)


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    b, h, s, d = x.shape
    assert d % 2 == 0 and x.stride(-1) == 1, (x.shape, x.stride())
    assert cos.shape == sin.shape and cos.shape[-2:] == (s, d) and cos.shape[0] in (1, b), cos.shape
    assert cos.stride() == sin.stride() and cos.stride(-1) == 1, (cos.stride(), sin.stride())
    y = torch.empty_like(x)  # x's layout (dense: q/k are [B, S, H, D] or [B, H, S, D] views)
    block_d = triton.next_power_of_2(d // 2)
    block_s = max(1, min(64, 4096 // block_d))
    if x.numel():
        _rope_kernel[(triton.cdiv(s, block_s), b * h)](
            x, cos, sin, y, s, h, *x.stride()[:3], *y.stride()[:3],
            cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1),
            HALF=d // 2, BACKWARD=backward, UPCAST=INTERPRETED, BLOCK_S=block_s, BLOCK_D=block_d,
            num_warps=4,
            **pdl(),
        )
    return y


def rope_train(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _launch(x, cos, sin, backward=False)


def rope_train_backward(g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _launch(g, cos, sin, backward=True)
