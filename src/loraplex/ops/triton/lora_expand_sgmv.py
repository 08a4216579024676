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
from loraplex.ops.triton.lora_common import lora_tiles, slice_starts


# Tuned on H200 for Llama-3.1-8B prefill (benchmarks/kernels.py; benchmarks/NOTES.md).
BLOCK_M, BLOCK_N, NUM_WARPS = 64, 128, 4


def expand_config(num_tokens: int) -> dict:
    """Few tokens (a small or graph-captured batch): one tile covers a group's tokens."""
    block_m = BLOCK_M if num_tokens > 64 else max(16, triton.next_power_of_2(num_tokens))
    return dict(BLOCK_M=block_m, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS)


@triton.jit(do_not_specialize=["num_tiles", "m_blocks"])
def _lora_expand_kernel(
    buf_ptr, b_ptr, y_ptr,
    sorted_ids_ptr, group_slots_ptr, group_starts_ptr, group_ranks_ptr,
    tiles_ptr, num_tiles, m_blocks,
    slice_starts_ptr,
    stride_bs, stride_bm, stride_br,
    stride_wl, stride_wn, stride_wr,
    stride_ym, stride_yn,
    N_BLOCKS_PER_SLICE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr, EXPLICIT_TILES: tl.constexpr,
):
    pid_sn = tl.program_id(0)  # slice * N_BLOCKS_PER_SLICE + column block
    tile = tl.program_id(1)
    s = pid_sn // N_BLOCKS_PER_SLICE
    col0 = tl.load(slice_starts_ptr + s)
    col_end = tl.load(slice_starts_ptr + s + 1)
    n0 = col0 + (pid_sn % N_BLOCKS_PER_SLICE) * BLOCK_N
    if n0 >= col_end:
        return
    if EXPLICIT_TILES:
        group = tl.load(tiles_ptr + tile)
        m0 = tl.load(tiles_ptr + num_tiles + tile)
    else:
        group = tile // m_blocks
        m0 = tl.load(group_starts_ptr + group) + (tile % m_blocks) * BLOCK_M
    slot = tl.load(group_slots_ptr + group)
    if slot < 0:
        return
    end = tl.load(group_starts_ptr + group + 1)
    if m0 >= end:
        return
    rank = tl.load(group_ranks_ptr + group)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < end
    tokens = tl.load(sorted_ids_ptr + offs_m, mask=m_mask, other=0)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < col_end

    x = tl.load(
        buf_ptr + s * stride_bs + tokens[:, None] * stride_bm + offs_r[None, :] * stride_br,
        mask=m_mask[:, None] & r_mask[None, :], other=0.0,
    )
    w = tl.load(
        b_ptr + slot * stride_wl + offs_n[None, :] * stride_wn + offs_r[:, None] * stride_wr,
        mask=r_mask[:, None] & n_mask[None, :], other=0.0,
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
    tiles, num_tiles = lora_tiles(batch, num_tokens, cfg["BLOCK_M"])
    grid = (num_slices * n_blocks, num_tiles)
    _lora_expand_kernel[grid](
        buf, lora_b, y,
        batch.sorted_token_ids, batch.group_slots, batch.group_starts, batch.group_ranks,
        tiles if tiles is not None else batch.group_slots, num_tiles,
        triton.cdiv(num_tokens, cfg["BLOCK_M"]),
        slice_starts(tuple(slice_sizes), y.device),
        *buf.stride(),
        *lora_b.stride(),
        *y.stride(),
        N_BLOCKS_PER_SLICE=n_blocks,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_R=max(16, triton.next_power_of_2(max_rank)),
        DOT_PRECISION="ieee" if lora_b.dtype == torch.float32 else "tf32",
        EXPLICIT_TILES=tiles is not None,
        num_warps=cfg["num_warps"],
    )
