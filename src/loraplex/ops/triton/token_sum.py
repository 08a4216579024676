"""MoE training: each token's top_k expert rows summed back onto the token.

rows [P, D] are in expert-sorted order; flat pair t * top_k + j sits at row inv[...].
One program per (token, column block) gathers its k rows and sums them in float32: one
read of the rows and one write of [T, D], where eager torch writes and re-reads a
gathered [P, D] copy first (0.49 ms -> a third of that at 16K tokens x 8, D 2048).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.ops.triton.launch import pdl, wait_for_inputs


@triton.jit
def _token_sum_kernel(rows_ptr, inv_ptr, out_ptr, width, stride_r, stride_o,
                      TOP_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < width
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(inv_ptr + token * TOP_K + j).to(tl.int64)
        acc += tl.load(rows_ptr + row * stride_r + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + token.to(tl.int64) * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=m)


def sum_rows_by_token(rows: torch.Tensor, inv: torch.Tensor, top_k: int) -> torch.Tensor:
    width = rows.shape[1]
    assert rows.stride(1) == 1 and inv.is_contiguous()
    n_tokens = inv.numel() // top_k
    out = rows.new_empty(n_tokens, width)
    block = min(2048, triton.next_power_of_2(width))
    _token_sum_kernel[(n_tokens, triton.cdiv(width, block))](
        rows, inv, out, width, rows.stride(0), out.stride(0), TOP_K=top_k, BLOCK=block,
        num_warps=max(1, min(8, block // 256)), **pdl())
    return out
