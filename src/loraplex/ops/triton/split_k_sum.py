"""The second kernel of a split-K GEMM (int4_gemm.py's decode form, fp8_gemm.py's where a
config splits K): out[m] = the splits' float32 partial sums, added in split order, +
bias, rounded once to out's dtype.

An adapted projection's LoRA expand (ops.lora_linear) joins it where there is one: each
token's delta buf[slice(n), t, :r] @ B[slot(t), n, :r] is added before the one rounding,
which saves the expand's launch and its pass over the output. The shrink that wrote buf
may run on a side stream beside the GEMM: `FusedExpand.ready` joins it just before this
kernel, the first that reads buf.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraplex.ops.metadata import LoRABatch
from loraplex.ops.triton.launch import pdl, wait_for_inputs
from loraplex.ops.triton.lora_common import rank_ceil, slice_starts

SUM_BLOCK_N = 1024  # columns per program
SUM_LORA_BLOCK_N = 256  # ... with the LoRA expand ([BLOCK_N, rank] tiles of B)


@dataclass
class FusedExpand:
    """A LoRA expand for the sum to add: lora_expand's operands, and `ready`, called
    before the first kernel that reads buf (the shrink's stream joined)."""

    buf: torch.Tensor  # [S, T, R] float32
    lora_b: torch.Tensor  # [L, N, R]
    slice_sizes: tuple[int, ...]
    batch: LoRABatch
    ready: Callable[[], None]


@triton.jit(do_not_specialize=["M"])
def _split_k_sum_kernel(part_ptr, bias_ptr, out_ptr, M, N, stride_ps, stride_pm, stride_om,
                        buf_ptr, lora_b_ptr, token_slot_ptr, slot_ranks_ptr, starts_ptr,
                        stride_fs, stride_fm, stride_bl, stride_bn,
                        SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                        HAS_LORA: tl.constexpr, NUM_SLICES: tl.constexpr, BLOCK_R: tl.constexpr,
                        PDL: tl.constexpr = False):
    """out[m] = sum over the splits of part[s, m] (in split order) + bias (+ the token's
    LoRA delta: buf [S, M, R] float32 of the shrink, B [L, N, R]), rounded once."""
    wait_for_inputs(PDL)
    m = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * stride_ps + m * stride_pm + n, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    if HAS_LORA:
        slot = tl.load(token_slot_ptr + m)
        if slot >= 0:
            rank = tl.load(slot_ranks_ptr + slot)
            r = tl.arange(0, BLOCK_R)
            sl = tl.zeros((BLOCK_N,), dtype=tl.int32)  # each column's slice
            for i in tl.static_range(1, NUM_SLICES):
                sl += (n >= tl.load(starts_ptr + i)).to(tl.int32)
            v = tl.load(buf_ptr + sl[:, None] * stride_fs + m * stride_fm + r[None, :],
                        mask=mask[:, None] & (r < rank)[None, :], other=0.0)
            # B past the rank is zero in every slot: read to the rank rounded to 8.
            w = tl.load(lora_b_ptr + slot.to(tl.int64) * stride_bl + n[:, None] * stride_bn + r[None, :],
                        mask=mask[:, None] & (r < rank_ceil(rank))[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * v, axis=1)
    tl.store(out_ptr + m * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=mask)


def split_k_sum(parts: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                lora: FusedExpand | None = None) -> None:
    """out [M, N] = parts [SPLIT_K, M, N] (float32) summed + bias (+ lora's expand)."""
    split_k, m, n = parts.shape
    block_n = SUM_BLOCK_N if lora is None else SUM_LORA_BLOCK_N
    if lora is not None:
        buf, lora_b = lora.buf, lora.lora_b
        assert buf.shape[:2] == (len(lora.slice_sizes), m), (buf.shape, m)
        assert lora_b.shape[1] == n == sum(lora.slice_sizes), (lora_b.shape, lora.slice_sizes)
        assert buf.stride(2) == 1 and lora_b.stride(2) == 1
        lora.ready()
        lora_args = (buf, lora_b, lora.batch.token_slot, lora.batch.slot_ranks,
                     slice_starts(lora.slice_sizes, out.device), buf.stride(0), buf.stride(1),
                     lora_b.stride(0), lora_b.stride(1))
    else:
        lora_args = (parts,) * 5 + (0,) * 4
    _split_k_sum_kernel[(m, triton.cdiv(n, block_n))](
        parts, bias if bias is not None else parts, out, m, n,
        parts.stride(0), parts.stride(1), out.stride(0), *lora_args,
        SPLIT_K=split_k, HAS_BIAS=bias is not None, BLOCK_N=block_n, HAS_LORA=lora is not None,
        NUM_SLICES=len(lora.slice_sizes) if lora is not None else 1,
        BLOCK_R=triton.next_power_of_2(lora.buf.shape[2]) if lora is not None else 1,
        **pdl(),
    )
