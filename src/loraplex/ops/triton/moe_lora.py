"""Adapters on routed experts: delta[pair] = (in_row(pair) @ A[s, e].T) @ B[s, e].T, where
s is the pair's token's slot and e its expert. The grouped GEMM (moe_gemm.py) adds it to
its accumulator before the activation (gate/up) or the routing weight (down): no output
makes a round trip through memory to receive it.

Why pairs sorted by (slot, expert), with their own alignment (moe_align.align_lora):
each block then holds one (slot, expert) group, so a program loads one A (or B) and
runs full tl.dot tiles, exactly like the base GEMM. The alternative, reusing the
expert-sorted blocks with a grid dimension over adapter slots and rows masked to the
slot, launches max_loras x blocks programs and multiplies mostly masked rows; the
sort is one more single-program launch, shared by the gate/up and down paths.
Tokens in slot -1 are in no block; their delta rows are never written (the GEMM does
not read them). A/B columns past an adapter's rank are zero in the slot buffers, so
computing all R columns is exact. One kernel does both products per block (the shrunk
rows stay in registers) and writes the delta rows in delta's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.ops.triton.gemm_tiles import col_tile, row_tile
from loraplex.ops.triton.launch import pdl, wait_for_inputs
from loraplex.ops.triton.lora_common import rank_ceil
from loraplex.ops.triton.moe_align import Alignment
from loraplex.ops.triton.precision import dot_settings

BLOCK_K, BLOCK_N, NUM_WARPS = 64, 128, 4


def lora_block_m(num_pairs: int) -> int:
    """Decode: most (slot, expert) groups hold a pair or two, so the smallest tl.dot
    tile wastes least; prefill: larger groups amortise each A/B load over more rows."""
    return 16 if num_pairs <= 1024 else 64


@triton.jit(do_not_specialize=["num_pairs", "num_experts"])
def _moe_lora_kernel(
    in_ptr, a_ptr, b_ptr, delta_ptr, sorted_ids_ptr, block_groups_ptr, num_valid_ptr, ranks_ptr,
    K, N, num_pairs, num_experts,
    stride_im, stride_ik, stride_al, stride_ae, stride_ar, stride_ak,
    stride_bl, stride_be, stride_bn, stride_br, stride_dm, stride_dn,
    R: tl.constexpr, ROW_DIV: tl.constexpr, HAS_RANKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One program per aligned block: shrink its rows by A[s, e] into registers, then walk
    every column block of B[s, e] and store the delta rows. The [rows, R] intermediate
    never leaves the program: one launch per projection, nothing to zero or re-read."""
    wait_for_inputs(PDL)
    blk = tl.program_id(0)
    if blk * BLOCK_M >= tl.load(num_valid_ptr):
        return
    group = tl.load(block_groups_ptr + blk)
    slot, expert = (group // num_experts).to(tl.int64), (group % num_experts).to(tl.int64)
    pairs = tl.load(sorted_ids_ptr + blk * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = pairs < num_pairs
    rows = (pairs // ROW_DIV).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    b_r_mask = r_mask
    if HAS_RANKS:  # A and B are zero past the slot's rank: do not read them (B up to the
        # rank rounded to 8, whole 16-byte vectors)
        rank = tl.load(ranks_ptr + slot)
        r_mask = offs_r < rank
        b_r_mask = offs_r < rank_ceil(rank)
    offs_k = tl.arange(0, BLOCK_K)
    in_rows = in_ptr + rows[:, None] * stride_im
    a_cols = a_ptr + slot * stride_al + expert * stride_ae + offs_r[None, :] * stride_ar

    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        x = row_tile(in_rows, k, K, m_mask, stride_ik, EVEN_K, UPCAST)
        a = col_tile(a_cols, k, K, r_mask, stride_ak, EVEN_K, UPCAST)
        acc += tl.dot(x, a, input_precision=DOT_PRECISION)

    b_rows = b_ptr + slot * stride_bl + expert * stride_be + offs_r[:, None] * stride_br
    out_rows = delta_ptr + pairs.to(tl.int64)[:, None] * stride_dm
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        w = tl.load(b_rows + offs_n[None, :] * stride_bn, mask=b_r_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:
            w = w.to(tl.float32)
        delta = tl.dot(acc.to(w.dtype), w, input_precision=DOT_PRECISION)
        # EVEN_N: rows alone are masked, so the delta is stored in 16-byte vectors.
        mask = m_mask[:, None] if EVEN_N else m_mask[:, None] & n_mask[None, :]
        tl.store(out_rows + offs_n[None, :] * stride_dn, delta.to(delta_ptr.dtype.element_ty), mask=mask)


def moe_lora(inp: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, delta: torch.Tensor,
             align: Alignment, row_div: int, ranks: torch.Tensor | None = None) -> None:
    """delta[pair] = (inp[pair // row_div] @ A[s, e].T) @ B[s, e].T for the pairs of `align`
    (from align_lora); other rows are left as they are. lora_a [L, E, R, K]; lora_b
    [L, E, N, R]; delta [P, N]; ranks: int32 [L], each slot's rank (A/B zero past it)."""
    _, num_experts, rank, k = lora_a.shape
    n = lora_b.shape[2]
    assert inp.shape[1] == k and delta.shape == (align.num_pairs, n), (inp.shape, lora_a.shape, delta.shape)
    assert inp.dtype == lora_a.dtype == lora_b.dtype, (inp.dtype, lora_a.dtype, lora_b.dtype)
    if align.num_blocks == 0:
        return
    _moe_lora_kernel[(align.num_blocks,)](
        inp, lora_a, lora_b, delta, align.sorted_ids, align.block_groups, align.num_valid,
        ranks if ranks is not None else align.num_valid,
        k, n, align.num_pairs, num_experts,
        *inp.stride(), *lora_a.stride(), *lora_b.stride(), *delta.stride(),
        R=rank, ROW_DIV=row_div, HAS_RANKS=ranks is not None, BLOCK_M=align.block_m,
        BLOCK_R=max(16, triton.next_power_of_2(rank)),  # tl.dot needs >= 16 on a GPU
        BLOCK_K=BLOCK_K, BLOCK_N=BLOCK_N, EVEN_K=k % BLOCK_K == 0, EVEN_N=n % BLOCK_N == 0,
        **dot_settings(inp.dtype), num_warps=NUM_WARPS,
        **pdl(),
    )
