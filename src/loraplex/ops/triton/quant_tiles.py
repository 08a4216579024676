"""Quantized weight tiles dequantized in registers, for the kernels that read a
QuantizedWeight's bytes (ops/formats): the values ops.dequantize gives, bit for bit.

`mxfp4_cols` / `fp8_cols` give one K step of W.T, [BLOCK_K, N] (as gemm_tiles.col_tile
does for a plain weight), from `cols` [1, N] pointers to the weight's rows and their
scales (MXFP4: the step's tile, `mxfp4_scales`; FP8: `scale_cols` [1, N] pointers).
Values are the matmul operand: computed in float32 (code x scale), rounded once to the
activations' dtype (`like_ptr`'s element type) as dequantize rounds to w.dtype; under
the interpreter (UPCAST) read back as float32 (precision.py), the rounding kept.

Hopper has no FP4 MMA, and FP8 MMA needs the activations quantized too, which only
W8A8 weights ask for (Fp8Weight.act_block: `fp8_w8a8_step`, both operands e4m3): else
both formats feed bf16 (or the model's dtype) operands to tl.dot, float32 accumulation.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from loraplex.ops.formats import MXFP4_BLOCK, Fp8Weight, Mxfp4Weight, QuantizedWeight
from loraplex.ops.triton.precision import INTERPRETED

FORCED_MXFP4_PATH = os.environ.get("LORAPLEX_MXFP4_PATH") or None
# Taller blocks (prefill) keep the MX dot: Triton runs it on wgmma with the upcast
# weights as the register operand, where the PTX decode feeds mma.sync (gpt-oss-20b
# MXFP4, 16 x 1,600-token prompts in flight: TTFT 1,031 ms with PTX prefill, 405 ms
# without, H100).
PTX_MAX_BLOCK_M = 32


@triton.jit
def operand(x, like_ptr, UPCAST: tl.constexpr):
    """float32 values rounded (to nearest even) to like_ptr's element type; UPCAST: as
    float32 again (the interpreter's float32 -> bf16 cast truncates: rounded by hand)."""
    if not UPCAST:
        y = x.to(like_ptr.dtype.element_ty)
    elif like_ptr.dtype.element_ty == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        y = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    else:
        y = x.to(like_ptr.dtype.element_ty).to(tl.float32)
    return y


@triton.jit
def e2m1(code):
    """int32 e2m1 codes (0..15: sign bit 3, exponent bits 2..1, mantissa bit 0) -> float32
    (0, +-0.5, 1, 1.5, 2, 3, 4, 6), built as float32 bits."""
    e = (code >> 1) & 3
    m = code & 1
    # Normal (e > 0): 2^(e - 1) (1 + m / 2); subnormal (e = 0): m / 2, i.e. 0.5 or 0.
    bits = tl.where(e > 0, ((e + 126) << 23) | (m << 22), m * (126 << 23))
    return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def e8m0(s):
    """int32 e8m0 scales (0..254) -> float32 2^(s - 127) (2^-127 is a float32 subnormal)."""
    return tl.where(s == 0, 0x00400000, s << 23).to(tl.float32, bitcast=True)


@triton.jit
def mxfp4_values(data, scale, like_ptr, UPCAST: tl.constexpr):
    """(low nibbles, high nibbles) of the bytes `data` (int32 tile) = (W at k = 2j, W at
    k = 2j + 1) of byte j, each e2m1 x 2^(s - 127), s the e8m0 `scale` (int32, a tile
    of data's shape)."""
    s = e8m0(scale)
    return operand(e2m1(data & 15) * s, like_ptr, UPCAST), operand(e2m1(data >> 4) * s, like_ptr, UPCAST)


@triton.jit
def fp8_values(data_ptrs, scale, mask, like_ptr, UPCAST: tl.constexpr):
    """e4m3 values at data_ptrs times their float32 scale (a tile that broadcasts to
    them: one per output row of the step, or one per element). Masked values are 0."""
    q = tl.load(data_ptrs, mask=mask, other=0.0)
    return operand(q.to(tl.float32) * scale, like_ptr, UPCAST)


@triton.jit
def mxfp4_cols(cols, scale, j0, KH, col_mask, stride_k, BLOCK_KH: tl.constexpr, EVEN_K: tl.constexpr,
               like_ptr, UPCAST: tl.constexpr):
    """(W.T at the even k, W.T at the odd k) of the step whose bytes are j0 .. j0 +
    BLOCK_KH of KH = K / 2 (k = 2 j0 ..), each [BLOCK_KH, N]: what a GEMM multiplies with
    the activations' even and odd columns (two dots, no interleaving shuffle). `scale`:
    the step's scales (mxfp4_scales), broadcast over their 16 bytes."""
    data = mxfp4_data(cols, j0, KH, col_mask, stride_k, BLOCK_KH, EVEN_K)
    return mxfp4_values(data.to(tl.int32), per_byte(scale).to(tl.int32), like_ptr, UPCAST)


@triton.jit
def mxfp4_data(cols, j0, KH, col_mask, stride_k, BLOCK_KH: tl.constexpr, EVEN_K: tl.constexpr):
    """The step's bytes j0 .. j0 + BLOCK_KH of W.T, [BLOCK_KH, N] uint8."""
    j = j0 + tl.arange(0, BLOCK_KH)
    if EVEN_K:
        return tl.load(cols + j[:, None] * stride_k, mask=col_mask[None, :], other=0)
    return tl.load(cols + j[:, None] * stride_k, mask=col_mask[None, :] & (j < KH)[:, None], other=0)


@triton.jit
def mxfp4_scales(scale_cols, j0, KH, col_mask, stride_sk, BLOCK_KH: tl.constexpr, PADDED: tl.constexpr):
    """The e8m0 scales of the step from byte j0, [BLOCK_KH / 16, N] uint8 (one per 16
    bytes; masked ones 127: 1). PADDED: each row's storage holds every step's scales
    (Mxfp4Weight.padded_scales), so a step past K reads padding and needs no mask along
    K: a column's scales of a step are then one 4-byte load (BLOCK_KH 64), which Triton's
    pipeline copies ahead; byte loads stay out of it, and their latency stood in front
    of each step."""
    g = j0 // 16 + tl.arange(0, BLOCK_KH // 16)
    if PADDED:
        return tl.load(scale_cols + g[:, None] * stride_sk, mask=col_mask[None, :], other=127)
    return tl.load(scale_cols + g[:, None] * stride_sk, mask=col_mask[None, :] & (g * 16 < KH)[:, None],
                   other=127)


@triton.jit
def mxfp4_scale_pair(scale_cols, up_offset, j0, KH, col_mask, stride_sk, BLOCK_KH: tl.constexpr,
                     PADDED: tl.constexpr):
    """mxfp4_scales of the columns `scale_cols` and of those up_offset on (a fused
    gate/up weight's up rows) in one load: a thread's 4 bytes even where one tile of a
    narrow block gives it 2 (BLOCK_N 64, 4 warps), which Triton's pipeline would not copy."""
    both = scale_cols[:, :, None] + (tl.arange(0, 2) * up_offset)[None, None, :]  # [1, N, 2]
    g = j0 // 16 + tl.arange(0, BLOCK_KH // 16)
    mask = col_mask[None, :, None]
    if not PADDED:
        mask = mask & (g * 16 < KH)[:, None, None]
    return tl.split(tl.load(both + g[:, None, None] * stride_sk, mask=mask, other=127).to(tl.int32))


@triton.jit
def per_byte(group_values):
    """[G, N] values of 16-byte groups -> [16 G, N], each repeated over its group's bytes."""
    g: tl.constexpr = group_values.shape[0]
    n: tl.constexpr = group_values.shape[1]
    return tl.reshape(tl.broadcast_to(group_values[:, None, :], (g, 16, n)), (16 * g, n))


# Two bytes -> the bf16x2 of their low (or high) nibbles, bits placed, not computed: an
# e2m1 code s|e1 e0|m put at bf16 bits 15 | 8 7 | 6 reads as its value times 2^-126
# (e > 0: 2^(e - 127)(1 + m / 2); e = 0: the subnormal m x 2^-127), so one bf16x2
# multiply by 2^(s - 1) finishes both values (exact: a power of two; subnormals kept).
# A nibble at bits 0-3 of each 16-bit half goes to 6-8 and 15 by one multiply by
# 0x1040 (x << 6 + x << 12, the copies disjoint) and one mask. Per 4 bytes: 2 PRMT
# spreading bytes (0, 1) and (2, 3) to half words, then 4 x (AND, IMAD, AND, HMUL2):
# 2.25 instructions per value.
_E2M1_PAIRS_ASM = tl.constexpr("""
{
.reg .b32 y01, y23, t;
prmt.b32 y01, $4, 0, 0x4140;
prmt.b32 y23, $4, 0, 0x4342;
and.b32 t, y01, 0x000F000F;
mul.lo.u32 t, t, 0x1040;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $0, t, $5;
and.b32 t, y23, 0x000F000F;
mul.lo.u32 t, t, 0x1040;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $1, t, $6;
and.b32 t, y01, 0x00F000F0;
mul.lo.u32 t, t, 0x104;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $2, t, $5;
and.b32 t, y23, 0x00F000F0;
mul.lo.u32 t, t, 0x104;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $3, t, $6;
}
""")


@triton.jit
def mxfp4_bf16_cols(cols, scale, j0, KH, col_mask, stride_k, BLOCK_KH: tl.constexpr, EVEN_K: tl.constexpr):
    """mxfp4_cols for bf16 operands on a GPU, decoded by _E2M1_PAIRS_ASM: (W.T at the
    even k, W.T at the odd k), each [BLOCK_KH, N] bf16, dequantize's values exactly.
    Needs every scale at most 128 (2^(s - 1) a normal bf16: Mxfp4Weight.max_scale)."""
    data = mxfp4_data(cols, j0, KH, col_mask, stride_k, BLOCK_KH, EVEN_K)
    mult = ((scale.to(tl.int32) + 126) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)  # 2^(s - 1)
    return tl.inline_asm_elementwise(_E2M1_PAIRS_ASM, "=r,=r,=r,=r,r,r,r", [data, per_byte(mult)],
                                     dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)


# Two bytes -> the bf16x2 of their low (or high) nibbles' int4 weights, (q - zero) x
# scale: a nibble put under bf16's exponent of 2^7 (0x4300 | q) reads as 128 + q, so
# one bf16x2 subtraction of 128 + zero (exact: integers below 256) and one multiply by
# the scale (rounded once, as dequantize rounds its float32 product) finish both
# values. Per 4 bytes: 2 PRMT spreading bytes (0, 1) and (2, 3) to half words, then 4 x
# (mask and or, SUB2, MUL2) and 2 shifts: about 2 instructions per value, against ~10
# for the float32 decode. sub/mul.bf16x2 need sm_90.
_INT4_PAIRS_ASM = tl.constexpr("""
{
.reg .b32 y01, y23, t;
prmt.b32 y01, $4, 0, 0x4140;
prmt.b32 y23, $4, 0, 0x4342;
and.b32 t, y01, 0x000F000F;
or.b32 t, t, 0x43004300;
sub.rn.bf16x2 t, t, $5;
mul.rn.bf16x2 $0, t, $7;
and.b32 t, y23, 0x000F000F;
or.b32 t, t, 0x43004300;
sub.rn.bf16x2 t, t, $6;
mul.rn.bf16x2 $1, t, $8;
shr.b32 t, y01, 4;
and.b32 t, t, 0x000F000F;
or.b32 t, t, 0x43004300;
sub.rn.bf16x2 t, t, $5;
mul.rn.bf16x2 $2, t, $7;
shr.b32 t, y23, 4;
and.b32 t, t, 0x000F000F;
or.b32 t, t, 0x43004300;
sub.rn.bf16x2 t, t, $6;
mul.rn.bf16x2 $3, t, $8;
}
""")


@triton.jit
def int4_bf16_pairs(packed, zero, scale):
    """An int4 weight's bytes [N, B] uint8 (two codes a byte, the lower k in the low
    nibble) -> (W at the even k, W at the odd k), each [N, B] bf16, dequantize's values
    exactly, by _INT4_PAIRS_ASM. zero, scale: [N, 1] float32 and bf16, one group's (the
    step lies inside it); every zero an integer in 0..127 (Int4Weight.integer_zeros)."""
    zero128 = tl.broadcast_to((zero + 128.0).to(tl.bfloat16), packed.shape)
    scale = tl.broadcast_to(scale.to(tl.bfloat16), packed.shape)
    return tl.inline_asm_elementwise(_INT4_PAIRS_ASM, "=r,=r,=r,=r,r,r,r,r,r", [packed, zero128, scale],
                                     dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)


@triton.jit
def mxfp4_packed_cols(cols, scale_cols, j0, KH, col_mask, stride_k, stride_sk, BLOCK_KH: tl.constexpr,
                      EVEN_K: tl.constexpr):
    """The step's bytes j0 .. j0 + BLOCK_KH of W.T as stored, [BLOCK_KH, N] uint8 (two
    e2m1 per byte, the lower k in the low nibble), and their e8m0 scales [N, BLOCK_KH /
    16]: tl.dot_scaled's rhs operands, which Triton upcasts to bf16 with packed bf16x2
    arithmetic (~6 instructions per value on sm_90 against mxfp4_cols' ~15)."""
    j = j0 + tl.arange(0, BLOCK_KH)
    g = j0 // 16 + tl.arange(0, BLOCK_KH // 16)
    scale_rows = tl.trans(scale_cols)  # [N, 1] pointers
    if EVEN_K:
        data = tl.load(cols + j[:, None] * stride_k, mask=col_mask[None, :], other=0)
        scale = tl.load(scale_rows + g[None, :] * stride_sk, mask=col_mask[:, None], other=127)
    else:
        data = tl.load(cols + j[:, None] * stride_k, mask=col_mask[None, :] & (j < KH)[:, None], other=0)
        scale = tl.load(scale_rows + g[None, :] * stride_sk, mask=col_mask[:, None] & (g * 16 < KH)[None, :],
                        other=127)
    return data, scale


@triton.jit
def even_odd(t):
    """[M, 2n] -> (t[:, 0::2], t[:, 1::2]), each [M, n]: a contiguous tile of the
    activations split in registers to meet mxfp4_cols' even and odd rows."""
    return tl.split(tl.reshape(t, (t.shape[0], t.shape[1] // 2, 2)))


@triton.jit
def fp8_cols(cols, scale_cols, k, k0, K, col_mask, stride_k, stride_sk, SCALE_BLOCK: tl.constexpr,
             SCALE_PER_STEP: tl.constexpr, EVEN_K: tl.constexpr, like_ptr, UPCAST: tl.constexpr):
    """W.T at k [BLOCK_K] (the step from k0), [BLOCK_K, N]. SCALE_PER_STEP: the step lies
    in one scale block (block_k a multiple of BLOCK_K, or the whole K), one scale per
    column; otherwise each value's own."""
    mask = col_mask[None, :] if EVEN_K else col_mask[None, :] & (k < K)[:, None]
    if SCALE_PER_STEP:
        scale = tl.load(scale_cols + (k0 // SCALE_BLOCK) * stride_sk, mask=col_mask[None, :], other=0.0)
    else:
        scale = tl.load(scale_cols + (k // SCALE_BLOCK)[:, None] * stride_sk, mask=mask, other=0.0)
    return fp8_values(cols + k[:, None] * stride_k, scale, mask, like_ptr, UPCAST)


@triton.jit
def fp8_w8a8_step(a, a_scale, cols, scale_cols, k, k0, K, col_mask, stride_k, stride_sk,
                  SCALE_BLOCK: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr,
                  SWAP: tl.constexpr):
    """One K step of a W8A8 product, float32 [M, N] (SWAP: its transpose, [N, M]): a
    [M, BLOCK_K] e4m3 (float32 under the interpreter) times W.T at k as stored (e4m3:
    the MMA takes both as they are), scaled by a_scale [M] (a's block) and the columns'
    scale of the step's block (the step lies inside one block of each). SWAP puts W's
    rows on the MMA's M side: Hopper's wgmma needs 64 rows there, so a decode block of
    16 pairs would otherwise run mma.sync on operands converted to f16."""
    if SWAP:
        rows = tl.trans(cols)  # [N, 1]
        mask = col_mask[:, None] if EVEN_K else col_mask[:, None] & (k < K)[None, :]
        w = tl.load(rows + k[None, :] * stride_k, mask=mask, other=0.0)
        w_scale = tl.load(tl.trans(scale_cols) + (k0 // SCALE_BLOCK) * stride_sk, mask=col_mask[:, None],
                          other=0.0)
        if UPCAST:
            part = tl.dot(w.to(tl.float32), tl.trans(a), input_precision="ieee")
        else:
            part = tl.dot(w, tl.trans(a))
        part = part * (w_scale * a_scale[None, :])
    else:
        mask = col_mask[None, :] if EVEN_K else col_mask[None, :] & (k < K)[:, None]
        w = tl.load(cols + k[:, None] * stride_k, mask=mask, other=0.0)
        w_scale = tl.load(scale_cols + (k0 // SCALE_BLOCK) * stride_sk, mask=col_mask[None, :], other=0.0)
        if UPCAST:
            part = tl.dot(a, w.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, w)
        part = part * (a_scale[:, None] * w_scale)
    return part


# The formats the quantized expert kernels read (others, int4, are dequantized first).
KERNEL_FORMATS = (Mxfp4Weight, Fp8Weight)


def format_args(w: QuantizedWeight, block_k: int) -> dict:
    """The weight-format constexprs of the quantized expert kernels for K steps of
    block_k: FORMAT, SCALE_BLOCK (K values per scale), SCALE_PER_STEP (fp8_cols),
    PADDED_SCALES (mxfp4_scales)."""
    k = w.shape[-1]
    if isinstance(w, Mxfp4Weight):
        padded = w.padded_scales(triton.cdiv(k, block_k) * block_k // MXFP4_BLOCK)
        return dict(FORMAT="mxfp4", SCALE_BLOCK=MXFP4_BLOCK, SCALE_PER_STEP=False, PADDED_SCALES=padded)
    if isinstance(w, Fp8Weight):
        per_step = w.block_k % block_k == 0 or w.block_k >= k
        return dict(FORMAT="fp8", SCALE_BLOCK=w.block_k, SCALE_PER_STEP=per_step, PADDED_SCALES=False)
    raise TypeError(f"no Triton MoE kernel reads {type(w).__name__} experts")


def mxfp4_path(w: QuantizedWeight, block_m: int = 16) -> str:
    """How a kernel turns MXFP4 tiles into bf16 operands (moe_gemm_quant.py's docstring;
    the GEMV, moe_gemv_quant.py, takes "ptx" or decodes by hand):
    "ptx" (bf16 on a GPU, every scale at most 128, blocks of at most PTX_MAX_BLOCK_M
    pairs), "mx" (tl.dot_scaled: other bf16 cases), "hand" (other dtypes; not MXFP4).
    LORAPLEX_MXFP4_PATH=mx|ptx|hand picks one where it applies (to compare them)."""
    if not isinstance(w, Mxfp4Weight):
        return "hand"
    if w.dtype != torch.bfloat16:
        return "hand"
    max_scale = None if INTERPRETED or w.device.type != "cuda" else w.max_scale()
    fits = max_scale is not None and max_scale <= 128
    path = FORCED_MXFP4_PATH or ("ptx" if fits and block_m <= PTX_MAX_BLOCK_M else "mx")
    return "mx" if path == "ptx" and not fits else path
