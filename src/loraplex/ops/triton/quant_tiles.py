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


def _forced_mxfp4_path() -> str | None:
    """LORAPLEX_MXFP4_PATH: unset, or "hand" (the portable decode everywhere, to compare it
    with the PTX one). Any other value (such as "mx", a path that is gone) is refused
    where the kernels are imported: at startup."""
    value = os.environ.get("LORAPLEX_MXFP4_PATH") or None
    if value not in (None, "hand"):
        raise ValueError(f"LORAPLEX_MXFP4_PATH must be unset or 'hand', got {value!r}")
    return value


FORCED_MXFP4_PATH = _forced_mxfp4_path()


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


# e2m1 words (ops/formats/e2m1_words.py): which bits of a word become each bf16x2.
E2M1_PLACED = tl.constexpr(0x81C081C0)  # bf16 bits 15 | 8 7 | 6 of both halves
E2M1_ROTATE_1 = tl.constexpr(3)  # k = (4, 6) are there after a rotation right by 3,
E2M1_ROTATE_2 = tl.constexpr(6)  # k = (1, 3) after one by 6,
E2M1_SPREAD_MASK = tl.constexpr(0x001B001B)  # k = (5, 7) after a mask and a multiply
E2M1_SPREAD_MULT = tl.constexpr(0x4108)


@triton.jit
def e2m1_word_bits(word):
    """uint32 e2m1 words -> their values' codes placed at bf16 bits 15 | 8 7 | 6 of each
    half, as _E2M1_WORD_ASM places them: 4 tiles holding k = (0, 2), (4, 6), (1, 3),
    (5, 7) of each word (low half, high half)."""
    rotated_1 = (word >> E2M1_ROTATE_1) | (word << (32 - E2M1_ROTATE_1))
    rotated_2 = (word >> E2M1_ROTATE_2) | (word << (32 - E2M1_ROTATE_2))
    spread = (word & E2M1_SPREAD_MASK) * E2M1_SPREAD_MULT
    return word & E2M1_PLACED, rotated_1 & E2M1_PLACED, rotated_2 & E2M1_PLACED, spread & E2M1_PLACED


@triton.jit
def placed_code(bits, half):
    """The e2m1 code (0..15) e2m1_word_bits placed in half `half` (0 low, 1 high; an int
    or a tile)."""
    b = bits >> (16 * half)
    return (((b >> 6) & 7) | ((b >> 12) & 8)).to(tl.int32)


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
    the step's scales (mxfp4_scales), broadcast over their 16 bytes. Decoded in float32
    from the e2m1 words, each row j reading its whole word (the portable path: the
    interpreter, float16 / float32 activations)."""
    j = j0 + tl.arange(0, BLOCK_KH)
    words = (cols + (j - j % 4)[:, None] * stride_k).to(tl.pointer_type(tl.int32))
    mask = col_mask[None, :] if EVEN_K else col_mask[None, :] & (j < KH)[:, None]
    word = tl.load(words, mask=mask, other=0).to(tl.uint32, bitcast=True)
    k02, k46, k13, k57 = e2m1_word_bits(word)
    first = (j % 4 < 2)[:, None]  # bytes 0, 1 of a word: k = 0, 2 (even) and 1, 3 (odd)
    half = (j % 2)[:, None].to(tl.uint32)
    even = placed_code(tl.where(first, k02, k46), half)
    odd = placed_code(tl.where(first, k13, k57), half)
    s = e8m0(per_byte(scale).to(tl.int32))
    return operand(e2m1(even) * s, like_ptr, UPCAST), operand(e2m1(odd) * s, like_ptr, UPCAST)


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


# A word's 8 e2m1 values (ops/formats/e2m1_words.py) -> 4 bf16x2, bits placed, not
# computed: an e2m1 code s|e1 e0|m put at bf16 bits 15 | 8 7 | 6 reads as its value times
# 2^-126 (e > 0: 2^(e - 127)(1 + m / 2); e = 0: the subnormal m x 2^-127), so one bf16x2
# multiply by 2^(s - 1) finishes two values (exact: a power of two; subnormals kept).
# The layout has k = 0, 2 at those bits already (mask), k = 4, 6 and k = 1, 3 there after
# a rotation by 3 and 6 (rotate, mask), and k = 5, 7 where one multiply by 0x4108 puts
# them (four shifted copies, disjoint where the mask keeps them): 12 instructions a word,
# 1.5 a value (nibbles took 2.25: a PRMT spreading bytes, a multiply placing sign and
# magnitude apart). Outputs as pack=4 gives them: $0, $1 the even k of bytes (0, 1),
# (2, 3) of the word $4; $2, $3 the odd k; $5, $6 the bytes' multipliers (one scale a
# word: its 4 bytes lie in one 16-byte group). Unlike elementwise code, this reads the 4
# packed bytes as one word: the tiles it takes must give each thread a word's 4 bytes
# in order (the MMA operand layout's 4 consecutive k of 8-bit values does; the bf16
# kernels' tests compare every value with dequantize's on a GPU).
_E2M1_WORD_ASM = tl.constexpr(f"""
{{
.reg .b32 t;
and.b32 t, $4, {E2M1_PLACED.value:#x};
mul.rn.bf16x2 $0, t, $5;
shf.r.wrap.b32 t, $4, $4, {E2M1_ROTATE_1.value};
and.b32 t, t, {E2M1_PLACED.value:#x};
mul.rn.bf16x2 $1, t, $6;
shf.r.wrap.b32 t, $4, $4, {E2M1_ROTATE_2.value};
and.b32 t, t, {E2M1_PLACED.value:#x};
mul.rn.bf16x2 $2, t, $5;
and.b32 t, $4, {E2M1_SPREAD_MASK.value:#x};
mul.lo.u32 t, t, {E2M1_SPREAD_MULT.value:#x};
and.b32 t, t, {E2M1_PLACED.value:#x};
mul.rn.bf16x2 $3, t, $6;
}}
""")


@triton.jit
def mxfp4_bf16_cols(cols, scale, j0, KH, col_mask, stride_k, BLOCK_KH: tl.constexpr, EVEN_K: tl.constexpr):
    """mxfp4_cols for bf16 operands on a GPU, decoded by _E2M1_WORD_ASM: (W.T at the
    even k, W.T at the odd k), each [BLOCK_KH, N] bf16, dequantize's values exactly.
    Needs every scale at most 128 (2^(s - 1) a normal bf16: Mxfp4Weight.max_scale)."""
    data = mxfp4_data(cols, j0, KH, col_mask, stride_k, BLOCK_KH, EVEN_K)
    mult = ((scale.to(tl.int32) + 126) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)  # 2^(s - 1)
    return tl.inline_asm_elementwise(_E2M1_WORD_ASM, "=r,=r,=r,=r,r,r,r", [data, per_byte(mult)],
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


def mxfp4_path(w: QuantizedWeight) -> str:
    """How a kernel turns MXFP4 tiles into bf16 operands (moe_gemm_quant.py's docstring):
    "ptx" (bf16 on a GPU, every scale at most 128: mxfp4_bf16_cols), else "hand"
    (mxfp4_cols; and for any other weight). LORAPLEX_MXFP4_PATH=hand forces the portable
    decode (to compare them)."""
    if not isinstance(w, Mxfp4Weight) or w.dtype != torch.bfloat16:
        return "hand"
    max_scale = None if INTERPRETED or w.device.type != "cuda" else w.max_scale()
    fits = max_scale is not None and max_scale <= 128
    return "ptx" if fits and FORCED_MXFP4_PATH != "hand" else "hand"
