"""ops.dequantize of MXFP4 and FP8 weights in one kernel: W [..., N, K] written in w.dtype,
the values of the torch reference (ops/reference/quant.py) bit for bit, with no float32
or int64 temporaries (the reference's are several times W's size: a gpt-oss-20b layer's
gate/up stack is 0.5 G values). Training on a quantized base dequantizes a layer's weights
this way on each use (train/quantized.py). Int4 weights have theirs (int4_gemm.py).

Rows of every leading index are one [R, K] matrix; a program writes BLOCK_R rows x
BLOCK_K columns (TILES: few long rows a program ran fastest).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.ops.formats import MXFP4_BLOCK, Fp8Weight, Mxfp4Weight
from loraplex.ops.triton.launch import pdl, wait_for_inputs
from loraplex.ops.triton.precision import INTERPRETED
from loraplex.ops.triton.quant_tiles import e2m1, e2m1_word_bits, e8m0, fp8_values, operand, placed_code

# (BLOCK_R, BLOCK_K, num_warps) by format: gpt-oss-20b's MXFP4 experts (0.8 G values a
# layer) 0.64 ms on an H200 against 0.78 with 16 x 256, Qwen3-30B-A3B's FP8 ones (0.6 G)
# 0.51 against 0.77 (`python -m benchmarks.moe_kernels --sections prefill-quant`).
TILES = {"mxfp4": (8, 1024, 4), "fp8": (4, 1024, 4)}


@triton.jit
def _mxfp4_dequantize_kernel(data_ptr, scale_ptr, out_ptr, R, K, stride_sr, BLOCK_R: tl.constexpr,
                             BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr = False):
    """BLOCK_K values a row: BLOCK_K / 8 e2m1 words (formats/e2m1_words.py), one e8m0
    scale per 4 of them, loaded once and broadcast; each word's 8 values decoded apart
    (quant_tiles.e2m1_word_bits) and put in k order in registers (tl.join) so the row is
    stored contiguously."""
    wait_for_inputs(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    w = tl.program_id(1) * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)  # words: k = 8w .. 8w + 7
    g = tl.program_id(1) * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)  # their scales
    row_mask = (rows < R)[:, None]
    r64 = rows.to(tl.int64)[:, None]
    words = data_ptr.to(tl.pointer_type(tl.int32)) + r64 * (K // 8) + w[None, :]
    word = tl.load(words, mask=row_mask & (w < K // 8)[None, :], other=0).to(tl.uint32, bitcast=True)
    scale = e8m0(tl.load(scale_ptr + r64 * stride_sr + g[None, :], mask=row_mask & (g < K // 32)[None, :],
                         other=127).to(tl.int32))
    scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_R, BLOCK_K // 32, 4)),
                       (BLOCK_R, BLOCK_K // 8))  # a word's
    k02, k46, k13, k57 = e2m1_word_bits(word)
    v0, v2 = e2m1(placed_code(k02, 0)) * scale, e2m1(placed_code(k02, 1)) * scale
    v4, v6 = e2m1(placed_code(k46, 0)) * scale, e2m1(placed_code(k46, 1)) * scale
    v1, v3 = e2m1(placed_code(k13, 0)) * scale, e2m1(placed_code(k13, 1)) * scale
    v5, v7 = e2m1(placed_code(k57, 0)) * scale, e2m1(placed_code(k57, 1)) * scale
    # joined so that flattening the three new axes gives k = 0 .. 7 of each word
    vals = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + r64 * K + k[None, :], operand(tl.reshape(vals, (BLOCK_R, BLOCK_K)), out_ptr, UPCAST),
             mask=row_mask & (k < K)[None, :])


@triton.jit
def _fp8_dequantize_kernel(data_ptr, scale_ptr, out_ptr, R, K, NUM_SCALES, BLOCK_SCALE_K: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                           PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < R)[:, None] & (k < K)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    scale = tl.load(scale_ptr + r64 * NUM_SCALES + (k // BLOCK_SCALE_K)[None, :], mask=mask, other=1.0)
    w = fp8_values(data_ptr + r64 * K + k[None, :], scale, mask, out_ptr, UPCAST)
    tl.store(out_ptr + r64 * K + k[None, :], w, mask=mask)


def dequantize(w: Mxfp4Weight | Fp8Weight) -> torch.Tensor:
    """dequantize(w) [..., N, K] in w.dtype."""
    shape, k = w.shape, w.shape[-1]
    out = torch.empty(shape, dtype=w.dtype, device=w.data.device)
    rows = out.numel() // k if k else 0
    if rows == 0:
        return out
    data = w.data.contiguous()
    block_r, block_k, warps = TILES["mxfp4" if isinstance(w, Mxfp4Weight) else "fp8"]
    grid = (triton.cdiv(rows, block_r), triton.cdiv(k, block_k))
    if isinstance(w, Mxfp4Weight):
        assert k % MXFP4_BLOCK == 0
        scale = w.scale.reshape(rows, k // MXFP4_BLOCK)  # padded rows (Mxfp4Weight) stay a view
        _mxfp4_dequantize_kernel[grid](data, scale, out, rows, k, scale.stride(0), BLOCK_R=block_r,
                                       BLOCK_K=block_k, UPCAST=INTERPRETED, num_warps=warps, **pdl())
    else:
        scale = w.scale.contiguous()
        _fp8_dequantize_kernel[grid](data, scale, out, rows, k, scale.shape[-1], BLOCK_SCALE_K=w.block_k,
                                     BLOCK_R=block_r, BLOCK_K=block_k, UPCAST=INTERPRETED, num_warps=warps,
                                     **pdl())
    return out
