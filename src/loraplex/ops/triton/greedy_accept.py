"""Greedy verification of speculated tokens in one launch (ops.greedy_accept): per
sequence, the proposals read from the step's input ids are kept while each equals the
target's argmax before it, then the argmax after the last kept one is added. What the
host reads (ids, count kept, proposal length) is one row per sequence: one copy. Torch
ops took ~17 launches for this (argmax compares, cumprod, gathers, the padded output),
each a few microseconds of a verify step's host time, which bounds a small model's step."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.ops.triton.launch import pdl, wait_for_inputs


@triton.jit
def _greedy_accept_kernel(best_ptr, ids_ptr, spec_ptr, found_ptr, out_ptr, added_ptr, shift_ptr,
                          K1, K_BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    s = tl.program_id(0)
    first = tl.load(spec_ptr + s * 3)
    slots = tl.load(spec_ptr + s * 3 + 1)
    n = tl.load(found_ptr + tl.load(spec_ptr + s * 3 + 2)).to(tl.int64)
    j = tl.arange(0, K_BLOCK)
    best = tl.load(best_ptr + s * K1 + j, mask=j < K1, other=-1)
    drafts = tl.load(ids_ptr + first + 1 + j, mask=j < n, other=-2)
    # The first proposal not kept (or n, all kept): the count kept.
    accepted = tl.min(tl.where((drafts == best) & (j < n), K_BLOCK, j), axis=0)
    extra = tl.sum(tl.where(j == accepted, best, 0), axis=0)
    out = tl.where(j < accepted, drafts, tl.where(j == accepted, extra, -1))
    row = out_ptr + s * (K1 + 2)
    tl.store(row + j, out, mask=j < K1)
    tl.store(row + K1, accepted.to(tl.int64))
    tl.store(row + K1 + 1, n)
    tl.store(added_ptr + s, extra)
    tl.store(shift_ptr + s, (accepted - slots).to(tl.int32))


def greedy_accept(best, input_ids, spec, found):
    num_seqs, k1 = best.shape
    verified = torch.empty(num_seqs, k1 + 2, dtype=torch.int64, device=best.device)
    added = torch.empty(num_seqs, dtype=torch.int64, device=best.device)
    shift = torch.empty(num_seqs, dtype=torch.int32, device=best.device)
    if num_seqs:
        assert best.is_contiguous() and spec.is_contiguous()
        _greedy_accept_kernel[(num_seqs,)](best, input_ids, spec, found, verified, added, shift, k1,
                                           K_BLOCK=triton.next_power_of_2(k1), num_warps=1, **pdl())
    return verified, added, shift
