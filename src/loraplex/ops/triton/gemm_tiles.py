"""The K-step tiles of a GEMM whose rows are gathered (LoRA shrink, MoE grouped GEMM,
expert LoRA): one place for their masks and for the interpreter's upcast.

`rows` are [M, 1] pointers to the gathered rows, `cols` [1, N] pointers to the weight's
columns (the weight read transposed); k the K offsets of this step. Without EVEN_K the
tail of K is masked too.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_tile(rows, k, K, row_mask, stride_k, EVEN_K: tl.constexpr, UPCAST: tl.constexpr):
    """[M, BLOCK_K]: the rows' values at k."""
    mask = row_mask[:, None] if EVEN_K else row_mask[:, None] & (k[None, :] < K)
    t = tl.load(rows + k[None, :] * stride_k, mask=mask, other=0.0)
    return t.to(tl.float32) if UPCAST else t


@triton.jit
def col_tile(cols, k, K, col_mask, stride_k, EVEN_K: tl.constexpr, UPCAST: tl.constexpr):
    """[BLOCK_K, N]: the weight columns' values at k."""
    mask = col_mask[None, :] if EVEN_K else col_mask[None, :] & (k[:, None] < K)
    t = tl.load(cols + k[:, None] * stride_k, mask=mask, other=0.0)
    return t.to(tl.float32) if UPCAST else t
