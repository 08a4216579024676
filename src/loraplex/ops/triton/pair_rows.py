"""MoE training: each token's row copied to its top_k expert-sorted pair rows (the
gather in front of the grouped expert GEMMs, forward and backward; the inverse of
token_sum.py's sum).

Flat pair t * top_k + j sits at sorted row inv[...]. One program per (token, column
block) reads the token's row once and writes it to its k rows, optionally into rows
`extra` columns wider (room for a folded projection's LoRA intermediate: train/expert_gemm.py,
FoldedStack), so no padded copy of the input is made first. torch's `x[tokens]` reads
the token rows k times (H100, 16K tokens x 8, width 2048: 0.36 ms; 0.48 ms into rows
16 wider after a 0.09 ms pad copy).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.ops.triton.launch import pdl, wait_for_inputs


@triton.jit
def _pair_rows_kernel(x_ptr, inv_ptr, out_ptr, width, stride_x, stride_o,
                      TOP_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < width
    v = tl.load(x_ptr + token.to(tl.int64) * stride_x + cols, mask=m, other=0.0)
    for j in tl.static_range(TOP_K):
        row = tl.load(inv_ptr + token * TOP_K + j).to(tl.int64)
        tl.store(out_ptr + row * stride_o + cols, v, mask=m)


def copy_rows_to_pairs(x: torch.Tensor, inv: torch.Tensor, top_k: int, extra: int = 0) -> torch.Tensor:
    n_tokens, width = x.shape
    assert x.stride(1) == 1 and inv.is_contiguous() and inv.numel() == n_tokens * top_k
    out = x.new_empty(inv.numel(), width + extra)  # the extra columns are the caller's
    block = min(2048, triton.next_power_of_2(width))
    if n_tokens:
        _pair_rows_kernel[(n_tokens, triton.cdiv(width, block))](
            x, inv, out, width, x.stride(0), out.stride(0), TOP_K=top_k, BLOCK=block,
            num_warps=max(1, min(8, block // 256)), **pdl())
    return out
