"""LoRA expand for decode, one program per (token, column block), fused with the add:
y[t, n] += buf[s, t, :r] @ B[slot(t), n, :r].T for the BLOCK_N columns n of one slice.

B[slot] rows are r contiguous values, so a [BLOCK_N, r] block is one contiguous read.
The product is reduced in registers (no tensor-core tile for a single token) and added
into the base projection's output in place. Tokens without an adapter exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.ops.metadata import LoRABatch
from loraplex.ops.triton.launch import pdl, wait_for_inputs
from loraplex.ops.triton.lora_common import column_alignment, rank_ceil, slice_starts

# Tuned on H200 for Llama-3.1-8B decode (benchmarks/kernels.py; benchmarks/LOG.md).
BLOCK_N = 256


@triton.jit
def _expand_gemv_kernel(
    buf_ptr, b_ptr, y_ptr, token_slot_ptr, slot_ranks_ptr, slice_starts_ptr,
    stride_bs, stride_bm, stride_wl, stride_wn, stride_ym,
    N_BLOCKS_PER_SLICE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    ALIGN: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    pid_sn = tl.program_id(0)
    t = tl.program_id(1)
    s = pid_sn // N_BLOCKS_PER_SLICE
    # Slice offsets come from memory, so the compiler knows nothing of their alignment
    # unless told: without the hints every y access is a 2-byte load or store.
    col_end = tl.multiple_of(tl.load(slice_starts_ptr + s + 1), ALIGN)
    n0 = tl.multiple_of(tl.load(slice_starts_ptr + s), ALIGN) + (pid_sn % N_BLOCKS_PER_SLICE) * BLOCK_N
    if n0 >= col_end:
        return
    slot = tl.load(token_slot_ptr + t)
    if slot < 0:
        return
    rank = tl.load(slot_ranks_ptr + slot)
    r = tl.arange(0, BLOCK_R)
    n = n0 + tl.arange(0, BLOCK_N)
    n_mask = n < col_end
    v = tl.load(buf_ptr + s * stride_bs + t * stride_bm + r, mask=r < rank, other=0.0)
    # B's columns past the rank are zero in every slot (`AdapterSlots`), so B is read up
    # to the rank rounded up to 8 columns: whole 16-byte vectors, the same products.
    w = tl.load(b_ptr + slot * stride_wl + n[:, None] * stride_wn + r[None, :],
                mask=n_mask[:, None] & (r < rank_ceil(rank))[None, :], other=0.0)
    delta = tl.sum(w.to(tl.float32) * v[None, :], axis=1)
    y = y_ptr + t * stride_ym + n
    out = tl.load(y, mask=n_mask, other=0.0).to(tl.float32) + delta
    tl.store(y, out.to(y_ptr.dtype.element_ty), mask=n_mask)



def lora_expand_gemv(buf: torch.Tensor, lora_b: torch.Tensor, y: torch.Tensor,
                     slice_sizes: tuple[int, ...], batch: LoRABatch) -> None:
    num_slices, num_tokens, max_rank = buf.shape
    assert lora_b.stride(2) == 1 and buf.stride(2) == 1 and y.stride(1) == 1
    block_n = min(BLOCK_N, triton.next_power_of_2(max(slice_sizes)))
    n_blocks = triton.cdiv(max(slice_sizes), block_n)
    _expand_gemv_kernel[(num_slices * n_blocks, num_tokens)](
        buf, lora_b, y, batch.token_slot, batch.slot_ranks, slice_starts(tuple(slice_sizes), y.device),
        buf.stride(0), buf.stride(1), lora_b.stride(0), lora_b.stride(1), y.stride(0),
        N_BLOCKS_PER_SLICE=n_blocks, BLOCK_N=block_n,
        BLOCK_R=triton.next_power_of_2(max_rank), ALIGN=column_alignment(slice_sizes),
        num_warps=4,
        **pdl(),
    )
