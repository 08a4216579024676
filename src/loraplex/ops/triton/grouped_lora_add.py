"""MoE training: the LoRA expand added into the base projection's output in place,
y[rows of expert e] += scale * xa[rows] @ b[e], over rows sorted by expert.

The grouped GEMM would write the [P, N] delta and an add re-read it beside y: four
passes over [P, N] (1.1 GB per projection at 16K tokens on Qwen3-30B-A3B's shapes) where
this makes two. Rows come in fixed blocks of the sorted order, so no tile table is
built: a program finds the expert of its first row by binary search over the experts'
row ends and walks every expert segment its block touches (usually one or two),
accumulating each segment's rank-r product before one read-add-write of y.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.ops.triton.launch import pdl, wait_for_inputs
from loraplex.ops.triton.precision import dot_settings

BLOCK_M, BLOCK_N, NUM_WARPS = 64, 128, 4


@triton.jit
def _grouped_lora_add_kernel(
    y_ptr, xa_ptr, b_ptr, ends_ptr, n_rows, n_cols, rank, num_experts, scale,
    stride_ym, stride_xm, stride_xr, stride_be, stride_br, stride_bn,
    LOG_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    EVEN_N: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    row0 = tl.program_id(0) * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    rows64 = rows.to(tl.int64)
    row_ok = rows < n_rows
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < rank

    # the expert of row0: the first e with ends[e] > row0
    lo = 0
    hi = num_experts
    for _ in tl.static_range(LOG_E):
        mid = (lo + hi) // 2
        active = lo < hi
        end_mid = tl.load(ends_ptr + mid, mask=active & (mid < num_experts), other=0)
        left = end_mid > row0
        hi = tl.where(active & left, mid, hi)
        lo = tl.where(active & (end_mid <= row0), mid + 1, lo)
    e = lo
    seg_start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
    tile_end = tl.minimum(row0 + BLOCK_M, n_rows)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    while (e < num_experts) & (seg_start < tile_end):
        seg_end = tl.load(ends_ptr + e)
        in_seg = (rows >= seg_start) & (rows < seg_end)
        x = tl.load(xa_ptr + rows64[:, None] * stride_xm + offs_r[None, :] * stride_xr,
                    mask=in_seg[:, None] & r_ok[None, :], other=0.0)
        b_e = b_ptr + e.to(tl.int64) * stride_be
        w = tl.load(b_e + offs_r[:, None] * stride_br + cols[None, :] * stride_bn,
                    mask=r_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(x.to(w.dtype), w, input_precision=DOT_PRECISION)
        seg_start = seg_end
        e += 1

    y = y_ptr + rows64[:, None] * stride_ym + cols[None, :]
    mask = row_ok[:, None] if EVEN_N else row_ok[:, None] & col_ok[None, :]
    out = tl.load(y, mask=mask, other=0.0).to(tl.float32) + scale * acc
    tl.store(y, out.to(y_ptr.dtype.element_ty), mask=mask)


def grouped_lora_add(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, ends: torch.Tensor,
                     scale: float) -> None:
    n_rows, n_cols = y.shape
    num_experts, rank = b.shape[0], b.shape[1]
    assert y.stride(1) == 1 and xa.shape == (n_rows, rank) and b.shape[2] == n_cols
    assert ends.numel() == num_experts and ends.is_contiguous()
    grid = (triton.cdiv(n_rows, BLOCK_M), triton.cdiv(n_cols, BLOCK_N))
    _grouped_lora_add_kernel[grid](
        y, xa, b, ends, n_rows, n_cols, rank, num_experts, float(scale),
        y.stride(0), *xa.stride(), *b.stride(),
        LOG_E=max(1, num_experts.bit_length()), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        BLOCK_R=max(16, triton.next_power_of_2(rank)), EVEN_N=n_cols % BLOCK_N == 0,
        **dot_settings(b.dtype), num_warps=NUM_WARPS,
        **pdl(),
    )
