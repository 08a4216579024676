"""Dynamic FP8 activations for W8A8 GEMMs: x [T, K] -> e4m3 q [T, K] and float32 scales
[T, ceil(K / block)], one per row and `block` columns (ops.reference.quant
.quantize_activations, bit for bit: IEEE divisions for the scale and its reciprocal,
round to nearest even).

One program quantizes ROWS rows of one column block: the block's amax per row, its
scale, the row times the scale's reciprocal. A decode step's [16, 2048] is 16 programs; the W8A8
GEMMs then read e4m3 rows (half the bytes of bf16) and their scales once per K step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.ops.formats import Fp8Rows
from loraplex.ops.reference.quant import ACT_MIN_AMAX, FP8_MAX
from loraplex.ops.triton.launch import pdl, wait_for_inputs
from loraplex.ops.triton.precision import INTERPRETED

ROWS = 16


@triton.jit
def e4m3_rounded(v):
    """float32 v, |v| <= 448, rounded to the nearest e4m3fn value (even on ties), as
    float32: by hand, for the interpreter, whose float32 -> fp8 cast does not round so
    (the GPU's cvt.rn does). Normal values keep 3 mantissa bits; below 2^-6 the step is
    2^-9, which adding and taking away 2^14 (float32 ulp 2^-9) rounds to. The sign is
    v's sign bit (so -0 stays -0, as the GPU's conversion keeps it)."""
    a = tl.abs(v)
    bits = a.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    subnormal = (a + 16384.0) - 16384.0
    r = tl.where(a >= 0.015625, normal, subnormal)
    sign = v.to(tl.int32, bitcast=True) & -2147483648
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


_MIN_AMAX = tl.constexpr(ACT_MIN_AMAX)
_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def e4m3_rows(x, HAND_ROUND: tl.constexpr):
    """A block of activations, float32 [M, B] (B covering one quantization block of each
    row; masked values 0) -> (the e4m3 values, as float32 [M, B], and their scales [M]):
    quantize_activations' arithmetic, step by step (IEEE division for the scale and
    its reciprocal, one multiply per value)."""
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), _MIN_AMAX), _MAX)
    inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    v = tl.minimum(tl.maximum(x * inv[:, None], -_MAX), _MAX)
    if HAND_ROUND:
        v = e4m3_rounded(v)
    return v, scale


@triton.jit(do_not_specialize=["T"])
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, T, K, stride_xt, stride_qt, stride_st,
                          BLOCK: tl.constexpr, ROWS: tl.constexpr, EVEN_K: tl.constexpr,
                          HAND_ROUND: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    group = tl.program_id(1)
    cols = group * BLOCK + tl.arange(0, BLOCK)
    row_mask = rows < T
    mask = row_mask[:, None] if EVEN_K else row_mask[:, None] & (cols < K)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_xt + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    v, scale = e4m3_rows(x, HAND_ROUND)
    tl.store(q_ptr + rows64[:, None] * stride_qt + cols[None, :], v.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows64 * stride_st + group, scale, mask=row_mask)


def quantize_activations(x: torch.Tensor, block: int) -> Fp8Rows:
    """ops.reference.quant.quantize_activations for x [T, K] (last dim contiguous)."""
    assert x.dim() == 2 and x.stride(1) == 1 and block & (block - 1) == 0, (x.shape, block)
    t, k = x.shape
    groups = triton.cdiv(k, block)
    rows = q, scale = Fp8Rows.empty(t, k, block, x.device)
    if t == 0:
        return rows
    width = min(block, triton.next_power_of_2(k))  # a row shorter than one block
    _quantize_rows_kernel[(triton.cdiv(t, ROWS), groups)](
        x, q, scale, t, k, x.stride(0), q.stride(0), scale.stride(0),
        BLOCK=width, ROWS=ROWS, EVEN_K=k % width == 0,
        HAND_ROUND=INTERPRETED, num_warps=4,
        **pdl(),
    )
    return rows


def fp8_rows(x: torch.Tensor, block: int, given: Fp8Rows | None) -> Fp8Rows:
    """x's e4m3 rows for a W8A8 GEMM: `given` (written beside x by the op that wrote x),
    checked against x, or quantized now."""
    if given is None:
        return quantize_activations(x, block)
    given.check(x, block)
    return given
