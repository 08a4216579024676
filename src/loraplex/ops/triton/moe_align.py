"""Token-expert pairs sorted by group (expert, or adapter slot x expert) and padded so
that every block of BLOCK_M sorted entries belongs to one group: the grouped GEMMs then
read one weight matrix per block.

Pair i = t * top_k + j is token t's j-th routed expert. Each group's segment is padded to
a multiple of BLOCK_M with the sentinel P = T * top_k (an out-of-range pair that kernels
mask). Outputs have fixed sizes, from the worst case P + min(G, P) * (BLOCK_M - 1), and
nothing waits on the device, so the launch sequence can be captured in a CUDA graph;
kernels skip blocks past `num_valid`.

Why Triton programs: the same counting sort in torch ops is ~40 tiny launches, ~0.5 ms
of host time per call and ~60 us of a graph-replayed decode step (H100). Up to
ONE_PROGRAM_MAX_PAIRS pairs (decode) one program does it in a single launch. Its chunks
of pairs follow one another, each a few dependent trips to memory (ids, the counter's
atomic, the scatter), so a prompt step's 32,000 pairs took 117 us a layer (~280 us by
(slot, expert) with 8 adapters) in one program on an H200. Past that size the pairs are
counted in parallel, one chunk a program, the last program to finish (a ticket) lays
out the segments, and a second launch scatters them (benchmarks/LOG.md, "The alignment
in parallel for prompt steps"). Pairs take their place in their group by atomic
counters, so the order inside a group is arbitrary (each output row depends only on its
own pair).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraplex.ops.triton.launch import pdl, wait_for_inputs

CHUNK, NUM_WARPS = 1024, 8
# More pairs than this take the parallel form (_align_rank_kernel, _align_scatter_kernel).
ONE_PROGRAM_MAX_PAIRS = 1024


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
def _pair_keys(ids_ptr, slots_ptr, slot_mask_ptr, i, num_pairs, top_k, num_experts, HAS_SLOTS: tl.constexpr,
               HAS_MASK: tl.constexpr):
    """Group of pairs i, -1 for none (past num_pairs; by (slot, expert): slot * E + expert,
    -1 where the token has no adapter or its adapter no expert weights)."""
    key = tl.load(ids_ptr + i, mask=i < num_pairs, other=-1).to(tl.int32)
    if HAS_SLOTS:
        slot = tl.load(slots_ptr + i // top_k, mask=i < num_pairs, other=-1)
        if HAS_MASK:
            slot = tl.where(tl.load(slot_mask_ptr + slot, mask=slot >= 0, other=0) != 0, slot, -1)
        key = tl.where(slot >= 0, slot * num_experts + key, -1)
    return key


@triton.jit
def _fill(ptr, value, begin, end, CHUNK: tl.constexpr):
    offs = tl.arange(0, CHUNK)
    for s0 in range(begin, end, CHUNK):
        tl.store(ptr + s0 + offs, value, mask=s0 + offs < end)


@triton.jit
def _rank_pairs(key, i, counts_ptr, ranks_ptr):
    """Each pair's rank in its group, from the group's counter."""
    valid = key >= 0
    rank = tl.atomic_add(counts_ptr + key, 1, mask=valid)
    tl.store(ranks_ptr + i, rank, mask=valid)


@triton.jit
def _lay_out_segments(counts_ptr, starts_ptr, block_groups_ptr, num_valid_ptr, stats_ptr, num_groups,
                      num_blocks, BLOCK_M: tl.constexpr, HAS_STATS: tl.constexpr, CHUNK: tl.constexpr):
    """From the final counts (block_groups all -1): segment starts, num_valid and each
    block's group. One program."""
    offs = tl.arange(0, CHUNK)
    # Segment starts: exclusive prefix sum of the counts padded to BLOCK_M; each non-empty
    # group marks its first block.
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
    # Blocks take the last mark at or before them (groups ascend with blocks).
    run = -1
    for b0 in range(0, num_blocks, CHUNK):
        b = b0 + offs
        mark = tl.load(block_groups_ptr + b, mask=b < num_blocks, other=-1, volatile=True)
        mark = tl.maximum(tl.associative_scan(mark, 0, _max), run)
        run = tl.max(mark, 0)
        tl.store(block_groups_ptr + b, tl.where(b * BLOCK_M < total, mark, -1), mask=b < num_blocks)


@triton.jit
def _scatter_pairs(key, i, starts_ptr, ranks_ptr, sorted_ids_ptr):
    """Pair ids to their places: their segment's start plus their rank."""
    valid = key >= 0
    start = tl.load(starts_ptr + key, mask=valid, other=0, volatile=True)
    rank = tl.load(ranks_ptr + i, mask=valid, other=0, volatile=True)
    tl.store(sorted_ids_ptr + start + rank, i, mask=valid)


@triton.jit(do_not_specialize=["num_pairs", "top_k", "num_experts", "num_groups", "num_blocks"])
def _moe_align_kernel(
    ids_ptr, slots_ptr, slot_mask_ptr, counts_ptr, starts_ptr, ranks_ptr,
    sorted_ids_ptr, block_groups_ptr, num_valid_ptr, stats_ptr,
    num_pairs, top_k, num_experts, num_groups, num_blocks,
    BLOCK_M: tl.constexpr, HAS_SLOTS: tl.constexpr, HAS_MASK: tl.constexpr, HAS_STATS: tl.constexpr,
    CHUNK: tl.constexpr, PDL: tl.constexpr = False,
):
    """The one-program form: every step over all the pairs, chunk after chunk."""
    wait_for_inputs(PDL)
    offs = tl.arange(0, CHUNK)
    # Zero counters, sentinel everywhere, no group for any block.
    _fill(counts_ptr, 0, 0, num_groups, CHUNK)
    _fill(sorted_ids_ptr, num_pairs, 0, num_blocks * BLOCK_M, CHUNK)
    _fill(block_groups_ptr, -1, 0, num_blocks, CHUNK)
    tl.debug_barrier()
    for i0 in range(0, num_pairs, CHUNK):
        i = i0 + offs
        key = _pair_keys(ids_ptr, slots_ptr, slot_mask_ptr, i, num_pairs, top_k, num_experts, HAS_SLOTS,
                         HAS_MASK)
        _rank_pairs(key, i, counts_ptr, ranks_ptr)
    tl.debug_barrier()
    _lay_out_segments(counts_ptr, starts_ptr, block_groups_ptr, num_valid_ptr, stats_ptr, num_groups,
                      num_blocks, BLOCK_M, HAS_STATS, CHUNK)
    for i0 in range(0, num_pairs, CHUNK):
        i = i0 + offs
        key = _pair_keys(ids_ptr, slots_ptr, slot_mask_ptr, i, num_pairs, top_k, num_experts, HAS_SLOTS,
                         HAS_MASK)
        _scatter_pairs(key, i, starts_ptr, ranks_ptr, sorted_ids_ptr)


@triton.jit(do_not_specialize=["num_pairs", "top_k", "num_experts", "num_groups", "num_blocks"])
def _align_rank_kernel(
    ids_ptr, slots_ptr, slot_mask_ptr, counts_ptr, ticket_ptr, starts_ptr, ranks_ptr, keys_ptr,
    sorted_ids_ptr, block_groups_ptr, num_valid_ptr, stats_ptr,
    num_pairs, top_k, num_experts, num_groups, num_blocks,
    BLOCK_M: tl.constexpr, HAS_SLOTS: tl.constexpr, HAS_MASK: tl.constexpr, HAS_STATS: tl.constexpr,
    CHUNK: tl.constexpr, PDL: tl.constexpr = False,
):
    """The parallel form's first launch, one chunk of pairs a program (counters and ticket
    zero): each program writes its share of the sentinels, ranks its pairs and keeps
    their groups; the last to take the ticket lays out the segments."""
    wait_for_inputs(PDL)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    size = num_blocks * BLOCK_M
    share = tl.cdiv(size, programs)
    _fill(sorted_ids_ptr, num_pairs, pid * share, tl.minimum((pid + 1) * share, size), CHUNK)
    i = pid * CHUNK + tl.arange(0, CHUNK)
    key = _pair_keys(ids_ptr, slots_ptr, slot_mask_ptr, i, num_pairs, top_k, num_experts, HAS_SLOTS, HAS_MASK)
    tl.store(keys_ptr + i, key, mask=i < num_pairs)
    _rank_pairs(key, i, counts_ptr, ranks_ptr)
    tl.debug_barrier()  # every thread's atomics and stores issued before the ticket is taken
    # acq_rel: the programs before published their counts; the last one sees them all.
    ticket = tl.atomic_add(ticket_ptr, 1)
    if ticket == programs - 1:
        _fill(block_groups_ptr, -1, 0, num_blocks, CHUNK)
        tl.debug_barrier()
        _lay_out_segments(counts_ptr, starts_ptr, block_groups_ptr, num_valid_ptr, stats_ptr, num_groups,
                          num_blocks, BLOCK_M, HAS_STATS, CHUNK)


@triton.jit(do_not_specialize=["num_pairs"])
def _align_scatter_kernel(keys_ptr, starts_ptr, ranks_ptr, sorted_ids_ptr, num_pairs, CHUNK: tl.constexpr,
                          PDL: tl.constexpr = False):
    """The parallel form's second launch: each program scatters its chunk's pairs."""
    wait_for_inputs(PDL)
    i = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    key = tl.load(keys_ptr + i, mask=i < num_pairs, other=-1)
    _scatter_pairs(key, i, starts_ptr, ranks_ptr, sorted_ids_ptr)


def _align(topk_ids: torch.Tensor, token_slot: torch.Tensor | None, num_experts: int,
           num_groups: int, block_m: int, slot_mask: torch.Tensor | None = None,
           stats: torch.Tensor | None = None) -> Alignment:
    t, top_k = topk_ids.shape
    p = t * top_k
    num_blocks = triton.cdiv(p + min(num_groups, p) * (block_m - 1), block_m)
    size = num_blocks * block_m
    i32 = dict(dtype=torch.int32, device=topk_ids.device)
    out = torch.empty(size + num_blocks + 1, **i32)
    sorted_ids, block_groups, num_valid = out[:size], out[size:size + num_blocks], out[size + num_blocks:]
    ids = topk_ids.contiguous()
    slots = dict(HAS_SLOTS=token_slot is not None, HAS_MASK=slot_mask is not None)
    if p and p <= ONE_PROGRAM_MAX_PAIRS:
        work = torch.empty(2 * num_groups + p, **i32)  # counters, segment starts, ranks
        _moe_align_kernel[(1,)](
            ids, token_slot if token_slot is not None else work, slot_mask if slot_mask is not None else work,
            work, work[num_groups:], work[2 * num_groups:],
            sorted_ids, block_groups, num_valid, stats if stats is not None else work,
            p, top_k, num_experts, num_groups, num_blocks,
            BLOCK_M=block_m, HAS_STATS=stats is not None, CHUNK=CHUNK, num_warps=NUM_WARPS, **slots, **pdl(),
        )
    elif p:
        work = torch.empty(2 * num_groups + 1 + 2 * p, **i32)  # counters, ticket, starts, ranks, keys
        work[:num_groups + 1].zero_()
        counts, ticket, starts = work[:num_groups], work[num_groups:], work[num_groups + 1:]
        ranks, keys = work[2 * num_groups + 1:], work[2 * num_groups + 1 + p:]
        grid = (triton.cdiv(p, CHUNK),)
        _align_rank_kernel[grid](
            ids, token_slot if token_slot is not None else work, slot_mask if slot_mask is not None else work,
            counts, ticket, starts, ranks, keys, sorted_ids, block_groups, num_valid,
            stats if stats is not None else work, p, top_k, num_experts, num_groups, num_blocks,
            BLOCK_M=block_m, HAS_STATS=stats is not None, CHUNK=CHUNK, num_warps=NUM_WARPS, **slots, **pdl(),
        )
        _align_scatter_kernel[grid](keys, starts, ranks, sorted_ids, p, CHUNK=CHUNK, num_warps=NUM_WARPS,
                                    **pdl())
    return Alignment(sorted_ids, block_groups, num_valid, num_blocks, block_m, p)


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
