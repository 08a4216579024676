"""Rotary position embedding (NeoX half-split) for q and k in one launch.

One program per token rotates all its query and key heads: pairs (i, i + D/2) turn by
position * inv_freq[i]. cos/sin come from a float32 table and are rounded to the model
dtype first, as Hugging Face does; the rotation itself is computed in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cs_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_cs,
    NUM_Q: tl.constexpr, NUM_K: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < HALF
    cos = tl.load(cs_ptr + pos * stride_cs + d, mask=d_mask, other=0.0)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + d, mask=d_mask, other=0.0)
    dtype = q_ptr.dtype.element_ty
    cos = cos.to(dtype).to(tl.float32)[None, :]
    sin = sin.to(dtype).to(tl.float32)[None, :]
    h = tl.arange(0, BLOCK_H)
    for which in tl.static_range(2):
        if which == 0:
            src, dst, n = q_ptr + t * stride_qt, qo_ptr + t * stride_qot, NUM_Q
            s_h, d_h = stride_qh, stride_qoh
        else:
            src, dst, n = k_ptr + t * stride_kt, ko_ptr + t * stride_kot, NUM_K
            s_h, d_h = stride_kh, stride_koh
        mask = (h[:, None] < n) & d_mask[None, :]
        x1 = tl.load(src + h[:, None] * s_h + d[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + h[:, None] * s_h + HALF + d[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(dst + h[:, None] * d_h + d[None, :], (x1 * cos - x2 * sin).to(dtype), mask=mask)
        tl.store(dst + h[:, None] * d_h + HALF + d[None, :], (x2 * cos + x1 * sin).to(dtype), mask=mask)


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_q, head_dim = q.shape
    num_k = k.shape[1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and head_dim % 2 == 0
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        q, k, q_out, k_out, positions, cos_sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos_sin.stride(0),
        NUM_Q=num_q, NUM_K=num_k, HALF=half,
        BLOCK_H=triton.next_power_of_2(max(num_q, num_k)),
        BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=4,
    )
    return q_out, k_out
