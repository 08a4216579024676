"""Token-expert pairs sorted by group (expert, or adapter slot x expert) and padded so
that every block of BLOCK_M sorted entries belongs to one group: the grouped GEMMs then
read one weight matrix per block.

Pair i = t * top_k + j is token t's j-th routed expert. Each group's segment is padded to
a multiple of BLOCK_M with the sentinel P = T * top_k (an out-of-range pair that kernels
mask). Outputs have fixed sizes, from the worst case P + min(G, P) * (BLOCK_M - 1), and
nothing waits on the device, so the launch sequence can be captured in a CUDA graph;
kernels skip blocks past `num_valid`.

Why one Triton program: the same counting sort in torch ops is ~40 tiny launches, ~0.5 ms
of host time per call and ~60 us of a graph-replayed decode step (H100); one program
does it in a single launch. Pairs take their place in their group by atomic counters, so
the order inside a group is arbitrary (each output row depends only on its own pair).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraplex.ops.triton.launch import pdl, wait_for_inputs

CHUNK, NUM_WARPS = 1024, 8


@dataclass
class Alignment:
    sorted_ids: torch.Tensor  # [num_blocks * block_m] int32: pair ids by group, sentinel P pads
    block_groups: torch.Tensor  # [num_blocks] int32: group of each block, -1 past num_valid
    num_valid: torch.Tensor  # [1] int32: sorted entries in use (a multiple of block_m)
    num_blocks: int  # the grid's worst case; blocks at or past num_valid exit at once
    block_m: int
    num_pairs: int  # P, the sentinel


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _slot_key(expert, i, slots_ptr, slot_mask_ptr, num_pairs, top_k, num_experts, HAS_MASK: tl.constexpr):
    """Group slot * E + expert of pair i, or -1: no adapter, or one without expert weights."""
    slot = tl.load(slots_ptr + i // top_k, mask=i < num_pairs, other=-1)
    if HAS_MASK:
        slot = tl.where(tl.load(slot_mask_ptr + slot, mask=slot >= 0, other=0) != 0, slot, -1)
    return tl.where(slot >= 0, slot * num_experts + expert, -1)


@triton.jit(do_not_specialize=["num_pairs", "top_k", "num_experts", "num_groups", "num_blocks"])
def _moe_align_kernel(
    ids_ptr, slots_ptr, slot_mask_ptr, counts_ptr, starts_ptr, ranks_ptr,
    sorted_ids_ptr, block_groups_ptr, num_valid_ptr, stats_ptr,
    num_pairs, top_k, num_experts, num_groups, num_blocks,
    BLOCK_M: tl.constexpr, HAS_SLOTS: tl.constexpr, HAS_MASK: tl.constexpr, HAS_STATS: tl.constexpr,
    CHUNK: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    offs = tl.arange(0, CHUNK)
    # 0. Initialise: zero counters, sentinel everywhere, no group for any block.
    for g0 in range(0, num_groups, CHUNK):
        tl.store(counts_ptr + g0 + offs, 0, mask=g0 + offs < num_groups)
    for s0 in range(0, num_blocks * BLOCK_M, CHUNK):
        tl.store(sorted_ids_ptr + s0 + offs, num_pairs, mask=s0 + offs < num_blocks * BLOCK_M)
    for b0 in range(0, num_blocks, CHUNK):
        tl.store(block_groups_ptr + b0 + offs, -1, mask=b0 + offs < num_blocks)
    tl.debug_barrier()
    # 1. Each pair's group, and its rank in the group from the group's counter.
    for i0 in range(0, num_pairs, CHUNK):
        i = i0 + offs
        key = tl.load(ids_ptr + i, mask=i < num_pairs, other=-1).to(tl.int32)
        if HAS_SLOTS:  # group slot * E + expert; tokens without an adapter: none
            key = _slot_key(key, i, slots_ptr, slot_mask_ptr, num_pairs, top_k, num_experts, HAS_MASK)
        valid = key >= 0
        rank = tl.atomic_add(counts_ptr + key, 1, mask=valid)
        tl.store(ranks_ptr + i, rank, mask=valid)
    tl.debug_barrier()
    # 2. Segment starts: exclusive prefix sum of the counts padded to BLOCK_M; each
    # non-empty group marks its first block.
    total = 0
    hit = 0
    for g0 in range(0, num_groups, CHUNK):
        g = g0 + offs
        count = tl.load(counts_ptr + g, mask=g < num_groups, other=0, volatile=True)
        padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        start = tl.cumsum(padded, 0) - padded + total
        tl.store(starts_ptr + g, start, mask=g < num_groups)
        tl.store(block_groups_ptr + start // BLOCK_M, g, mask=(g < num_groups) & (padded > 0))
        total += tl.sum(padded, 0)
        hit += tl.sum((count > 0).to(tl.int32), 0)
    tl.store(num_valid_ptr, total)
    if HAS_STATS:  # measuring: (groups hit, calls) added to float32 stats
        tl.atomic_add(stats_ptr, hit.to(tl.float32))
        tl.atomic_add(stats_ptr + 1, 1.0)
    tl.debug_barrier()
    # 3. Blocks take the last mark at or before them (groups ascend with blocks).
    run = -1
    for b0 in range(0, num_blocks, CHUNK):
        b = b0 + offs
        mark = tl.load(block_groups_ptr + b, mask=b < num_blocks, other=-1, volatile=True)
        mark = tl.maximum(tl.associative_scan(mark, 0, _max), run)
        run = tl.max(mark, 0)
        tl.store(block_groups_ptr + b, tl.where(b * BLOCK_M < total, mark, -1), mask=b < num_blocks)
    # 4. Scatter pair ids to their places.
    for i0 in range(0, num_pairs, CHUNK):
        i = i0 + offs
        key = tl.load(ids_ptr + i, mask=i < num_pairs, other=-1).to(tl.int32)
        if HAS_SLOTS:
            key = _slot_key(key, i, slots_ptr, slot_mask_ptr, num_pairs, top_k, num_experts, HAS_MASK)
        valid = key >= 0
        start = tl.load(starts_ptr + key, mask=valid, other=0, volatile=True)
        rank = tl.load(ranks_ptr + i, mask=valid, other=0, volatile=True)
        tl.store(sorted_ids_ptr + start + rank, i, mask=valid)


def _align(topk_ids: torch.Tensor, token_slot: torch.Tensor | None, num_experts: int,
           num_groups: int, block_m: int, slot_mask: torch.Tensor | None = None,
           stats: torch.Tensor | None = None) -> Alignment:
    t, top_k = topk_ids.shape
    p = t * top_k
    num_blocks = triton.cdiv(p + min(num_groups, p) * (block_m - 1), block_m)
    size = num_blocks * block_m
    i32 = dict(dtype=torch.int32, device=topk_ids.device)
    work = torch.empty(2 * num_groups + p, **i32)  # counters, segment starts, ranks
    out = torch.empty(size + num_blocks + 1, **i32)
    if p:
        _moe_align_kernel[(1,)](
            topk_ids.contiguous(), token_slot if token_slot is not None else work,
            slot_mask if slot_mask is not None else work,
            work, work[num_groups:], work[2 * num_groups:],
            out, out[size:], out[size + num_blocks:], stats if stats is not None else work,
            p, top_k, num_experts, num_groups, num_blocks,
            BLOCK_M=block_m, HAS_SLOTS=token_slot is not None, HAS_MASK=slot_mask is not None,
            HAS_STATS=stats is not None, CHUNK=CHUNK, num_warps=NUM_WARPS,
            **pdl(),
        )
    return Alignment(out[:size], out[size:size + num_blocks], out[size + num_blocks:], num_blocks,
                     block_m, p)


def align_experts(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                  stats: torch.Tensor | None = None) -> Alignment:
    """Pairs of topk_ids [T, top_k] grouped by expert. stats (float32 [2], measuring
    only): the number of experts hit, and 1, are added to it in the same launch."""
    return _align(topk_ids, None, num_experts, num_experts, block_m, stats=stats)


def align_lora(topk_ids: torch.Tensor, token_slot: torch.Tensor, num_experts: int,
               max_loras: int, block_m: int, slot_mask: torch.Tensor | None = None) -> Alignment:
    """Pairs of tokens with an adapter grouped by (slot, expert): group slot * E + expert.
    Pairs of tokens in slot -1 (token_slot [>= T] int32), or in a slot whose slot_mask
    entry is 0, belong to no block."""
    return _align(topk_ids, token_slot, num_experts, max_loras * num_experts, block_m, slot_mask)
