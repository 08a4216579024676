"""Rotary position embedding (NeoX half-split) for q and k in one launch.

One program per token rotates all its query and key heads: pairs (i, i + D/2) turn by
position * inv_freq[i]. cos/sin come from a float32 table and are rounded to the model
dtype first, as Hugging Face does; the rotation itself is computed in float32.
Models with per-head q/k RMSNorm (Qwen3, Gemma 3) normalise in the same program: the
program already holds each head's whole vector, and two launches per layer go.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.ops.metadata import QKNorm
from loraplex.ops.triton.launch import pdl, wait_for_inputs
from loraplex.ops.triton.rms_norm import scale_normed


@triton.jit
def head_norm(x1, x2, w_ptr, eps, dtype,
              HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    """Each head's RMSNorm (q/k norm) over its two halves x1, x2 [heads, BLOCK_HALF]
    (float32), rounded as ops.rms_norm rounds it."""
    d = tl.arange(0, BLOCK_HALF)
    rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
    w1 = tl.load(w_ptr + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    x1 = scale_normed(x1 * rstd[:, None], w1, dtype, UNIT_OFFSET).to(dtype).to(tl.float32)
    x2 = scale_normed(x2 * rstd[:, None], w2, dtype, UNIT_OFFSET).to(dtype).to(tl.float32)
    return x1, x2


@triton.jit
def cos_sin_at(cs_ptr, pos, stride_cs, dtype, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """cos and sin [1, BLOCK_HALF] of position pos, from the float32 table, rounded to the
    model dtype first as Hugging Face does, then float32."""
    d = tl.arange(0, BLOCK_HALF)
    cs = cs_ptr + pos * stride_cs + d
    cos = tl.load(cs, mask=d < HALF, other=0.0).to(dtype).to(tl.float32)[None, :]
    sin = tl.load(cs + HALF, mask=d < HALF, other=0.0).to(dtype).to(tl.float32)[None, :]
    return cos, sin


@triton.jit
def rotate_heads(
    src_ptr, stride_sh, dst_ptr, stride_dh, h0, n_heads, cos, sin, w_ptr, eps,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr, ROTATE: tl.constexpr,
):
    """Heads h0 .. h0 + BLOCK_H (of n_heads) of one token, at src_ptr + head * stride_sh:
    q/k norm (NORM), rotation (ROTATE; else copied), stored at dst_ptr + head * stride_dh.
    Shared with rotate_and_store."""
    h = h0 + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    mask = (h < n_heads)[:, None] & (d < HALF)[None, :]
    src = src_ptr + h[:, None] * stride_sh + d[None, :]
    dtype = src_ptr.dtype.element_ty
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        x1, x2 = head_norm(x1, x2, w_ptr, eps, dtype, HALF, BLOCK_HALF, UNIT_OFFSET)
    if ROTATE:
        x1, x2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    dst = dst_ptr + h[:, None] * stride_dh + d[None, :]
    tl.store(dst, x1.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, x2.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cs_ptr, qw_ptr, kw_ptr, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_cs,
    NUM_Q: tl.constexpr, NUM_K: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    t = tl.program_id(0)
    cos, sin = cos_sin_at(cs_ptr, tl.load(pos_ptr + t), stride_cs, q_ptr.dtype.element_ty, HALF, BLOCK_HALF)
    rotate_heads(q_ptr + t * stride_qt, stride_qh, qo_ptr + t * stride_qot, stride_qoh, 0, NUM_Q, cos, sin,
                 qw_ptr, eps, HALF, BLOCK_H, BLOCK_HALF, NORM, UNIT_OFFSET, True)
    rotate_heads(k_ptr + t * stride_kt, stride_kh, ko_ptr + t * stride_kot, stride_koh, 0, NUM_K, cos, sin,
                 kw_ptr, eps, HALF, BLOCK_H, BLOCK_HALF, NORM, UNIT_OFFSET, True)


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
    qk_norm: QKNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_q, head_dim = q.shape
    num_k = k.shape[1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and head_dim % 2 == 0
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        q, k, q_out, k_out, positions, cos_sin,
        qk_norm.q_weight if qk_norm else cos_sin, qk_norm.k_weight if qk_norm else cos_sin,
        qk_norm.eps if qk_norm else 0.0,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos_sin.stride(0),
        NUM_Q=num_q, NUM_K=num_k, HALF=half,
        BLOCK_H=triton.next_power_of_2(max(num_q, num_k)),
        BLOCK_HALF=triton.next_power_of_2(half),
        NORM=qk_norm is not None, UNIT_OFFSET=bool(qk_norm and qk_norm.unit_offset),
        num_warps=4,
        **pdl(),
    )
    return q_out, k_out
