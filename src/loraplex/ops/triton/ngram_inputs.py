"""A step's inputs for speculation planned ahead of results (ops.ngram_inputs): one
program per chunk moves its positions by what the previous step rejected, feeds its
pending token, records its tokens in the sequence's history and, for a chunk that
speculates, writes the n-gram proposal found in that history after them.

The search scores every earlier position e by how many tokens before it match the
sequence's suffix (up to N_MAX, one load per e and suffix token) and keeps the best
(match length, e) in a running maximum of `length * 2^32 + e`: the longest match, then
the latest. A 2K-token history is eight blocks of 256.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.ops.triton.launch import pdl, wait_for_inputs


@triton.jit
def _ngram_inputs_kernel(ids_ptr, pos_ptr, slots_ptr, seq_lens_ptr, tables_ptr, qsl_ptr, chunks_ptr,
                         last_ids_ptr, last_shift_ptr, hist_ptr, found_ptr, table_stride, hist_stride,
                         block_size, n_min, N_MAX: tl.constexpr, BLOCK: tl.constexpr, K_BLOCK: tl.constexpr,
                         PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    c = tl.program_id(0)
    src = tl.load(chunks_ptr + c * 3)
    row = tl.load(chunks_ptr + c * 3 + 1)
    k = tl.load(chunks_ptr + c * 3 + 2)
    a = tl.load(qsl_ptr + c)
    b = tl.load(qsl_ptr + c + 1)
    fed = src >= 0
    shift = tl.load(last_shift_ptr + src, mask=fed, other=0).to(tl.int64)
    if fed:
        tl.store(ids_ptr + a, tl.load(last_ids_ptr + src))
        tl.store(seq_lens_ptr + c, tl.load(seq_lens_ptr + c) + shift.to(tl.int32))
    hist_row = hist_ptr + row.to(tl.int64) * hist_stride
    known_end = b - k
    for start in range(a, b, BLOCK):
        t = start + tl.arange(0, BLOCK)
        m = t < b
        pos = tl.load(pos_ptr + t, mask=m, other=0) + shift
        tl.store(pos_ptr + t, pos, mask=m)
        page = tl.load(tables_ptr + c * table_stride + pos // block_size, mask=m, other=0).to(tl.int64)
        tl.store(slots_ptr + t, page * block_size + pos % block_size, mask=m)
        if row >= 0:
            km = m & (t < known_end)
            tl.store(hist_row + pos, tl.load(ids_ptr + t, mask=km, other=0).to(tl.int32), mask=km)
    count = tl.full([], 0, tl.int64)
    if (k > 0) & (row >= 0):
        tl.debug_barrier()  # the history written above is read below, across threads
        length = tl.load(pos_ptr + known_end - 1) + 1  # tokens known, the fed one included
        best = tl.full([], -1, tl.int64)
        for e0 in range(1, length, BLOCK):
            e = e0 + tl.arange(0, BLOCK)
            run = e < length
            matched = tl.zeros([BLOCK], tl.int64)
            for j in tl.static_range(N_MAX):
                tail = tl.load(hist_row + length - 1 - j, mask=length - 1 - j >= 0, other=-1)
                ok = run & (e - 1 - j >= 0)
                run = ok & (tl.load(hist_row + e - 1 - j, mask=ok, other=-2) == tail)
                matched += run.to(tl.int64)
            score = tl.where(matched >= n_min, matched * 4294967296 + e, -1)
            best = tl.maximum(best, tl.max(score, axis=0))
        if best >= 0:
            e_best = best % 4294967296
            count = k.to(tl.int64)
            j = tl.arange(0, K_BLOCK)
            jm = j < count
            # Past the history's end the sequence repeats with period length - e_best.
            drafts = tl.load(hist_row + e_best + j % (length - e_best), mask=jm, other=0)
            tl.store(ids_ptr + known_end + j, drafts.to(tl.int64), mask=jm)
            tl.store(hist_row + length + j, drafts, mask=jm)
    tl.store(found_ptr + c, count.to(tl.int32))


def ngram_inputs(input_ids, positions, slot_mapping, seq_lens, block_tables, query_start_loc,
                 chunks, last_ids, last_shift, history, block_size: int, n_min: int, n_max: int,
                 max_drafts: int):
    num_chunks = chunks.shape[0]
    found = torch.empty(num_chunks, dtype=torch.int32, device=input_ids.device)
    if num_chunks:
        assert chunks.is_contiguous() and history.stride(1) == 1 and block_tables.stride(1) == 1
        _ngram_inputs_kernel[(num_chunks,)](
            input_ids, positions, slot_mapping, seq_lens, block_tables, query_start_loc, chunks,
            last_ids, last_shift, history, found, block_tables.stride(0), history.stride(0),
            block_size, n_min, N_MAX=n_max, BLOCK=256, K_BLOCK=triton.next_power_of_2(max(1, max_drafts)),
            num_warps=4, **pdl())
    return found
