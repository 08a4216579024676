"""LoRA expand fused with the add, segmented GEMM form (prefill):
y[t, o_s:o_s+n_s] += buf[s, t, :r] @ B[slot(t), o_s:o_s+n_s, :r].T.

Each program takes BLOCK_M tokens of one adapter group and BLOCK_N output columns of one
slice, multiplies the shrunk activations by that slot's B (scaling already folded in) and
adds the result straight into the base projection's output, so the delta never makes a
round trip through memory. Tokens without an adapter belong to no group and are never
touched. The grid spans the widest slice; narrower slices' extra column blocks exit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.ops.metadata import LoRABatch
from loraplex.ops.triton.launch import pdl, wait_for_inputs
from loraplex.ops.triton.lora_common import column_alignment, rank_ceil, slice_starts
from loraplex.ops.triton.precision import dot_settings
from loraplex.ops.triton.segment_tiles import find_tile, max_tiles

# Tuned on H200 for Llama-3.1-8B prefill (benchmarks/prefill_lora.py; benchmarks/LOG.md).
# A program loads its B tile once and walks TILE_BLOCKS token blocks of its group. Blocks
# of 16 tokens: a step's decode tokens are one-token groups, and a 64-row tile computed
# 63 empty rows for each of them.
BLOCK_M, BLOCK_N, NUM_WARPS, TILE_BLOCKS = 16, 256, 4, 4


def expand_config(num_tokens: int) -> dict:
    """Few tokens (a small or graph-captured batch): one tile covers a group's tokens."""
    if num_tokens <= 64:
        return dict(BLOCK_M=max(16, triton.next_power_of_2(num_tokens)), BLOCK_N=128,
                    TILE_BLOCKS=1, num_warps=NUM_WARPS)
    return dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, TILE_BLOCKS=TILE_BLOCKS, num_warps=NUM_WARPS)


@triton.jit(do_not_specialize=["num_groups"])
def _lora_expand_kernel(
    buf_ptr, b_ptr, y_ptr,
    sorted_ids_ptr, group_slots_ptr, group_starts_ptr, group_ranks_ptr, num_groups,
    slice_starts_ptr,
    stride_bs, stride_bm, stride_br,
    stride_wl, stride_wn, stride_wr,
    stride_ym, stride_yn,
    N_BLOCKS_PER_SLICE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    TILE_BLOCKS: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    ALIGN: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    pid_sn = tl.program_id(0)  # slice * N_BLOCKS_PER_SLICE + column block
    tile = tl.program_id(1)
    s = pid_sn // N_BLOCKS_PER_SLICE
    # Alignment hints: offsets loaded from memory would otherwise make every y access 2 bytes.
    col0 = tl.multiple_of(tl.load(slice_starts_ptr + s), ALIGN)
    col_end = tl.multiple_of(tl.load(slice_starts_ptr + s + 1), ALIGN)
    n0 = col0 + (pid_sn % N_BLOCKS_PER_SLICE) * BLOCK_N
    if n0 >= col_end:
        return
    group, m0 = find_tile(tile, group_starts_ptr, num_groups, BLOCK_M * TILE_BLOCKS)
    if group >= num_groups:
        return
    slot = tl.load(group_slots_ptr + group)
    if slot < 0:
        return
    end = tl.minimum(tl.load(group_starts_ptr + group + 1), m0 + BLOCK_M * TILE_BLOCKS)
    rank = tl.load(group_ranks_ptr + group)

    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < col_end
    # B is zero past the rank in every slot: read whole vectors up to the rounded rank.
    w = tl.load(
        b_ptr + slot * stride_wl + offs_n[None, :] * stride_wn + offs_r[:, None] * stride_wr,
        mask=(offs_r < rank_ceil(rank))[:, None] & n_mask[None, :], other=0.0,
    )
    if UPCAST:
        w = w.to(tl.float32)
    for mb in range(m0, end, BLOCK_M):
        offs_m = mb + tl.arange(0, BLOCK_M)
        m_mask = offs_m < end
        tokens = tl.load(sorted_ids_ptr + offs_m, mask=m_mask, other=0)
        x = tl.load(
            buf_ptr + s * stride_bs + tokens[:, None] * stride_bm + offs_r[None, :] * stride_br,
            mask=m_mask[:, None] & r_mask[None, :], other=0.0,
        )
        delta = tl.dot(x.to(w.dtype), w, input_precision=DOT_PRECISION)
        y = y_ptr + tokens[:, None] * stride_ym + offs_n[None, :] * stride_yn
        mask = m_mask[:, None] & n_mask[None, :]
        out = tl.load(y, mask=mask, other=0.0).to(tl.float32) + delta
        tl.store(y, out.to(y_ptr.dtype.element_ty), mask=mask)


def lora_expand_sgmv(
    buf: torch.Tensor,
    lora_b: torch.Tensor,
    y: torch.Tensor,
    slice_sizes: tuple[int, ...],
    batch: LoRABatch,
) -> None:
    num_slices, num_tokens, max_rank = buf.shape
    assert lora_b.shape[1] == sum(slice_sizes) == y.shape[1], (lora_b.shape, slice_sizes, y.shape)
    assert len(slice_sizes) == num_slices and y.shape[0] == num_tokens
    cfg = expand_config(num_tokens)
    n_blocks = triton.cdiv(max(slice_sizes), cfg["BLOCK_N"])
    span = cfg["BLOCK_M"] * cfg["TILE_BLOCKS"]
    num_groups = batch.group_slots.shape[0]
    grid = (num_slices * n_blocks, max_tiles(num_tokens, num_groups, span))
    _lora_expand_kernel[grid](
        buf, lora_b, y,
        batch.sorted_token_ids, batch.group_slots, batch.group_starts, batch.group_ranks, num_groups,
        slice_starts(tuple(slice_sizes), y.device),
        *buf.stride(),
        *lora_b.stride(),
        *y.stride(),
        N_BLOCKS_PER_SLICE=n_blocks,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_R=max(16, triton.next_power_of_2(max_rank)),
        TILE_BLOCKS=cfg["TILE_BLOCKS"],
        **dot_settings(lora_b.dtype),
        ALIGN=column_alignment(slice_sizes),
        num_warps=cfg["num_warps"],
        **pdl(),
    )
