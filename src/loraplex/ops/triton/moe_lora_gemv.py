"""Adapters on routed experts for decode, one program per (pair, column split), GEMV form:
delta[pair] = (in_row(pair) @ A[s, e].T) @ B[s, e].T, s the pair's token's slot, e its
expert.

In a decode step nearly every (slot, expert) group holds one pair: 16 requests of 16
adapters routed to 8 of 128 experts make 128 groups of 128 pairs. The aligned form
(moe_lora.py) then needs its own sort (a single-program launch over max_loras x E
groups) and runs 16-row tensor-core tiles with one row in use. Here each pair brings
its own A and B, read once (the same bytes the aligned form reads), multiplied and
reduced in registers; no alignment, and the grid depends on the pair count alone, so a
CUDA graph serves any routing and adapter mix. The shrunk [R] row stays in registers;
with N_SPLIT > 1 each program recomputes it (A again, from L2) and expands its share of
B's rows, so that a step's few pairs still fill the GPU. Pairs of tokens without an
adapter on these experts exit at once and their delta rows are left unwritten, unless
every row is to be written (ALL_ROWS: zeros for those pairs), so that the grouped GEMM
adding the deltas reads each pair's row without first loading its token's slot and the
slot's mask (fused_moe.py). Where the deltas are terms of the top-k sum (WEIGHTED, with
ALL_ROWS) each is multiplied by its routing weight and written in the output's dtype
beside the GEMM's rows. Without B (EXPAND off) each pair's shrunk [R] row is the output:
the GEMV form of the expert GEMMs expands it (moe_gemv_quant.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.ops.triton.launch import pdl, wait_for_inputs
from loraplex.ops.triton.lora_common import rank_ceil

# Tuned on H200 at 16 decode tokens, Qwen3-30B-A3B and gpt-oss-20b experts
# (benchmarks/decode_lora_probe.py; benchmarks/LOG.md). Tiles are sized by element
# count, so a lower rank gets longer tiles of the same bytes (rank 32: A tiles of 512
# columns and B tiles of 256 rows; rank 16: 1024 and 512).
A_TILE, B_TILE, NUM_WARPS = 16384, 8192, 8
# Software-pipelined loops (tl.range num_stages: the next tiles' loads are in flight
# while this one is multiplied): a program is a chain of ~10 dependent tile loads, and
# its time is their latency, not the bytes.
NUM_STAGES = 3


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_lora_gemv_kernel(
    in_ptr, ids_ptr, token_slot_ptr, slot_mask_ptr, ranks_ptr, a_ptr, b_ptr, delta_ptr, weights_ptr,
    K, N, num_pairs,
    stride_im, stride_al, stride_ae, stride_ar, stride_bl, stride_be, stride_bn, stride_dm,
    TOP_K: tl.constexpr, ROW_DIV: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_RANKS: tl.constexpr, N_SPLIT: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    NUM_STAGES: tl.constexpr, EXPAND: tl.constexpr = True, ALL_ROWS: tl.constexpr = False,
    WEIGHTED: tl.constexpr = False, PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    pair = tl.program_id(0)
    split = tl.program_id(1)
    # Loads are issued before the branches that need them, two round trips in all: the
    # slot with the expert, then the slot's mask with its rank.
    slot = tl.load(token_slot_ptr + pair // TOP_K)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    valid = slot >= 0
    r = tl.arange(0, BLOCK_R)
    if HAS_MASK:
        valid &= tl.load(slot_mask_ptr + slot, mask=valid, other=0) != 0
    if HAS_RANKS:  # A and B are zero past the slot's rank: not read (B up to the rank
        # rounded to 8, whole 16-byte vectors)
        rank = tl.load(ranks_ptr + slot, mask=slot >= 0, other=0)
        a_mask, b_mask = r < rank, r < rank_ceil(rank)
    else:
        a_mask = r < R
        b_mask = a_mask
    if ALL_ROWS:  # uncovered pairs run through reading nothing (zeros stored)
        a_mask = tl.where(valid, a_mask, False)  # (a scalar & a tile: the interpreter's mask breaks)
        b_mask = tl.where(valid, b_mask, False)
    elif not valid:
        return
    slot = slot.to(tl.int64)
    in_row = in_ptr + (pair // ROW_DIV).to(tl.int64) * stride_im
    a_rows = a_ptr + slot * stride_al + expert * stride_ae + r[:, None] * stride_ar
    offs_k = tl.arange(0, BLOCK_K)
    # Accumulate elementwise, reduce once: the loop is loads and FMAs only.
    acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + offs_k
        if EVEN_K:
            x = tl.load(in_row + k)
            a = tl.load(a_rows + k[None, :], mask=a_mask[:, None], other=0.0)
        else:
            x = tl.load(in_row + k, mask=k < K, other=0.0)
            a = tl.load(a_rows + k[None, :], mask=a_mask[:, None] & (k < K)[None, :], other=0.0)
        acc += a.to(tl.float32) * x.to(tl.float32)[None, :]
    shrunk = tl.sum(acc, axis=1)
    if not EXPAND:  # the shrunk row itself, [R] at delta_ptr's row (the expand is the GEMV's)
        tl.store(delta_ptr + pair.to(tl.int64) * stride_dm + r, shrunk, mask=r < R)
        return

    if WEIGHTED:  # the routing weight, applied before the one rounding to delta's dtype
        shrunk *= tl.load(weights_ptr + pair)
    b_rows = b_ptr + slot * stride_bl + expert * stride_be + r[None, :]
    out_row = delta_ptr + pair.to(tl.int64) * stride_dm
    out_ty = delta_ptr.dtype.element_ty
    n_chunk = tl.cdiv(tl.cdiv(N, N_SPLIT), BLOCK_N) * BLOCK_N
    for n0 in tl.range(split * n_chunk, tl.minimum((split + 1) * n_chunk, N), BLOCK_N, num_stages=NUM_STAGES):
        n = n0 + tl.arange(0, BLOCK_N)
        if EVEN_N:
            w = tl.load(b_rows + n[:, None] * stride_bn, mask=b_mask[None, :], other=0.0)
            tl.store(out_row + n, tl.sum(w.to(tl.float32) * shrunk[None, :], axis=1).to(out_ty))
        else:
            w = tl.load(b_rows + n[:, None] * stride_bn, mask=(n < N)[:, None] & b_mask[None, :], other=0.0)
            tl.store(out_row + n, tl.sum(w.to(tl.float32) * shrunk[None, :], axis=1).to(out_ty), mask=n < N)


def moe_lora_gemv(inp: torch.Tensor, topk_ids: torch.Tensor, token_slot: torch.Tensor,
                  slot_mask: torch.Tensor | None, ranks: torch.Tensor | None,
                  lora_a: torch.Tensor, lora_b: torch.Tensor | None, delta: torch.Tensor,
                  row_div: int, weights: torch.Tensor | None = None, all_rows: bool = False) -> None:
    """delta[pair] = (inp[pair // row_div] @ A[s, e].T) @ B[s, e].T for every pair whose
    token (pair // top_k) is in a slot s >= 0 with slot_mask[s] != 0; e = topk_ids.flat[pair].
    Other rows are left as they are, or (all_rows) set to zero. lora_a [L, E, R, K];
    lora_b [L, E, N, R]; delta float32 [P, N]; ranks int32 [L] (A/B zero past them) or
    None. weights (float32 [P], the routing weights; with lora_b, implies all_rows):
    delta[pair] times weights[pair], rounded once to delta's dtype (any). lora_b None: the
    shrink alone, delta [P, R] = inp[pair // row_div] @ A[s, e].T (the GEMV form of the
    expert GEMMs expands it in its epilogue: moe_gemv_quant.py)."""
    t, top_k = topk_ids.shape
    p = t * top_k
    _, _, rank, k = lora_a.shape
    n = lora_b.shape[2] if lora_b is not None else rank
    assert inp.shape[1] == k and delta.shape == (p, n) and delta.stride(1) == 1, (inp.shape, delta.shape)
    assert lora_a.stride(3) == 1 and inp.stride(1) == 1 and (lora_b is None or lora_b.stride(3) == 1)
    if p == 0:
        return
    block_r = triton.next_power_of_2(rank)
    block_k = min(A_TILE // block_r, triton.next_power_of_2(k))
    block_n = min(B_TILE // block_r, triton.next_power_of_2(n))
    expand = lora_b is not None
    assert weights is None or (expand and weights.dtype == torch.float32 and weights.numel() == p)
    assert delta.dtype == torch.float32 or weights is not None, delta.dtype
    n_split = min(splits_per_pair(p, inp.device), triton.cdiv(n, block_n)) if expand else 1
    lora_b = lora_b if expand else lora_a  # (not read without the expand)
    _moe_lora_gemv_kernel[(p, n_split)](
        inp, topk_ids.contiguous(), token_slot, slot_mask if slot_mask is not None else token_slot,
        ranks if ranks is not None else token_slot, lora_a, lora_b, delta,
        weights if weights is not None else delta, k, n, p,
        inp.stride(0), *lora_a.stride()[:3], *lora_b.stride()[:3], delta.stride(0),
        TOP_K=top_k, ROW_DIV=row_div, R=rank, BLOCK_R=block_r,
        HAS_MASK=slot_mask is not None, HAS_RANKS=ranks is not None, N_SPLIT=n_split,
        BLOCK_K=block_k, BLOCK_N=block_n, EVEN_K=k % block_k == 0, EVEN_N=n % block_n == 0,
        NUM_STAGES=NUM_STAGES, EXPAND=expand, ALL_ROWS=all_rows or weights is not None,
        WEIGHTED=weights is not None, num_warps=NUM_WARPS,
        **pdl(),
    )


def splits_per_pair(num_pairs: int, device: torch.device) -> int:
    """Programs per pair: two while the pairs alone would leave half the SMs idle, else
    one. Each split reads A again (from L2): at 16 decode tokens one per pair was fastest
    for Qwen3-30B-A3B's 128 pairs, two for gpt-oss-20b's 64, four for neither."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    return 2 if 2 * num_pairs <= sms else 1
