"""Quantized weights in plain torch: dequantization (the oracle of every quantized
kernel), the matmul through it, and the quantizers random weights and
`--quantization fp8` use. Formats and layouts: ops/formats."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraplex.ops.formats import MXFP4_BLOCK, Fp8Weight, Int4Weight, Mxfp4Weight, QuantizedWeight
from loraplex.ops.formats.e2m1_words import from_nibbles_, to_nibbles

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
# e2m1 codes 0..15: sign bit 3, then exponent and mantissa.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K / 2] -> int64 [..., K]: low nibble first (k = 2j), then high."""
    p = packed.to(torch.int64)
    return torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Integer [..., K] in [0, 16) -> uint8 [..., K / 2] (unpack_nibbles' inverse)."""
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def dequantize(w: QuantizedWeight) -> torch.Tensor:
    """The weight [..., N, K] in w.dtype (float32 math, one rounding at the end)."""
    if isinstance(w, Fp8Weight):
        return fp8_values(w).to(w.dtype)
    if isinstance(w, Int4Weight):
        q = unpack_nibbles(w.data).float()
        zero = w.zero.float().repeat_interleave(w.group, dim=-1)
        scale = w.scale.float().repeat_interleave(w.group, dim=-1)
        return ((q - zero) * scale).to(w.dtype)
    if isinstance(w, Mxfp4Weight):
        codes = unpack_nibbles(to_nibbles(w.data))
        values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=w.data.device)[codes]
        exponent = w.scale.to(torch.int32).repeat_interleave(MXFP4_BLOCK, dim=-1) - 127
        return torch.ldexp(values, exponent.float()).to(w.dtype)
    raise TypeError(f"not a quantized weight: {type(w).__name__}")


def linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None, x_fp8=None) -> torch.Tensor:
    """ops.linear of a quantized weight (W8A8: x quantized here, from x; x_fp8, the same
    rows, is for kernels)."""
    if w8a8(w, x.numel() // max(x.shape[-1], 1)):  # e4m3 products, float32 sums, rounded once
        bias = None if bias is None else bias.float()
        return F.linear(dequantized_activations(x, w.act_block), fp8_values(w), bias).to(x.dtype)
    return F.linear(x, dequantize(w).to(x.dtype), bias)


# -- W8A8: activations quantized at run time (Fp8Weight.act_block) ------------------------

# A block of zeros keeps a tiny scale (its values stay 0), never a division by zero.
ACT_MIN_AMAX = 1e-10


def w8a8(w, tokens: int | None = None) -> bool:
    """Whether ops on w quantize their activations (Fp8Weight.act_block): a GEMM over
    `tokens` rows does from w.act_min_tokens on; None: whether any GEMM may."""
    return (isinstance(w, Fp8Weight) and w.act_block > 0
            and (tokens is None or tokens >= w.act_min_tokens))


def quantize_activations(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 activations, per row and `block` columns: scale = max(amax,
    ACT_MIN_AMAX) / 448 (float32), q = x * (1 / scale) rounded to e4m3 (nearest even;
    a multiply by the reciprocal, which kernels do cheaply, not a division per value).
    Returns (q [..., K] e4m3, scale [..., ceil(K / block)] float32): x ~= q * scale."""
    k = x.shape[-1]
    blocks = F.pad(x.float(), (0, -k % block)).unflatten(-1, (-1, block))
    scale = blocks.abs().amax(-1).clamp_min(ACT_MIN_AMAX) / FP8_MAX
    q = (blocks * (1.0 / scale)[..., None]).clamp(-FP8_MAX, FP8_MAX).flatten(-2)[..., :k]
    return q.to(torch.float8_e4m3fn), scale


def dequantized_activations(x: torch.Tensor, block: int) -> torch.Tensor:
    """float32 q * scale of quantize_activations: the activations a W8A8 GEMM multiplies."""
    q, scale = quantize_activations(x, block)
    k = x.shape[-1]
    return q.float() * scale.repeat_interleave(block, dim=-1)[..., :k]


def fp8_values(w: Fp8Weight) -> torch.Tensor:
    """data * scale in float32, unrounded: the weight a W8A8 GEMM multiplies (dequantize
    rounds it to w.dtype)."""
    return w.data.float() * w.scale.repeat_interleave(w.block_k, dim=-1)[..., :w.shape[-1]]


# -- quantizers (random weights, load-time quantization, tests) --------------------------

def quantize(w: QuantizedWeight, values: torch.Tensor) -> None:
    """w = values quantized in w's format (its block or group size; int4 asymmetric)."""
    if isinstance(w, Fp8Weight):
        quantize_fp8(values, w.block_k, out=w)
    elif isinstance(w, Int4Weight):
        quantize_int4(values, w.group, symmetric=False, out=w)
    elif isinstance(w, Mxfp4Weight):
        quantize_mxfp4(values, out=w)
    else:
        raise TypeError(f"not a quantized weight: {type(w).__name__}")


def quantize_fp8(w: torch.Tensor, block_k: int, out: Fp8Weight | None = None) -> Fp8Weight:
    """Per row and block_k columns: scale = amax / 448, data = round(w / scale) in e4m3."""
    *lead, n, k = w.shape
    out = out if out is not None else Fp8Weight(tuple(w.shape), block_k, w.dtype, w.device)
    pad = -k % block_k
    blocks = F.pad(w.float(), (0, pad)).unflatten(-1, (-1, block_k))
    scale = (blocks.abs().amax(-1) / FP8_MAX).clamp_min(1e-12)
    data = (blocks / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).flatten(-2)[..., :k]
    out.data.copy_(data.to(torch.float8_e4m3fn))
    out.scale.copy_(scale)
    return out


def quantize_int4(w: torch.Tensor, group: int, symmetric: bool, out: Int4Weight | None = None) -> Int4Weight:
    """Per row and group of K: asymmetric min/max to [0, 15], or symmetric around 8."""
    *lead, n, k = w.shape
    out = out if out is not None else Int4Weight(tuple(w.shape), group, w.dtype, w.device)
    g = w.float().unflatten(-1, (k // group, group))
    if symmetric:
        scale = (g.abs().amax(-1) / 7).clamp_min(1e-8)
        zero = torch.full_like(scale, 8.0)
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).clamp_min(1e-8)
        zero = (-lo / scale).round().clamp(0, 15)
    q = (g / scale[..., None] + zero[..., None]).round().clamp(0, 15).flatten(-2)
    out.data.copy_(pack_nibbles(q))
    out.scale.copy_(scale.to(out.scale.dtype))
    out.zero.copy_(zero.to(out.zero.dtype))
    return out


def quantize_mxfp4(w: torch.Tensor, out: Mxfp4Weight | None = None) -> Mxfp4Weight:
    """Per 32 values of K: the shared exponent floor(log2(amax)) - 2 (e2m1's largest
    exponent), each value rounded to the nearest e2m1 value (saturating at 6)."""
    *lead, n, k = w.shape
    out = out if out is not None else Mxfp4Weight(tuple(w.shape), w.dtype, w.device)
    g = w.float().unflatten(-1, (k // MXFP4_BLOCK, MXFP4_BLOCK))
    amax = g.abs().amax(-1).clamp_min(2.0**-126)
    exponent = (torch.floor(torch.log2(amax)) - 2).clamp(-127, 127)
    scaled = g / torch.ldexp(torch.ones_like(exponent), exponent)[..., None]
    values = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=w.device)
    magnitude = (scaled.abs()[..., None] - values).abs().argmin(-1)  # nearest of the 8 magnitudes
    codes = magnitude + 8 * (scaled < 0)
    from_nibbles_(out.data.copy_(pack_nibbles(codes.flatten(-2))))
    out.scale.copy_((exponent + 127).to(torch.uint8))
    return out
