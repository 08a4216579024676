"""Rotary for q and k, and k and v into the paged KV cache, in one launch
(ops.rotate_and_store).

One program per (token, group of BLOCK_H heads): q's groups first, then k's, then v's.
A program loads its heads' two halves, normalises (q/k norm) and rotates q and k as the
rotary kernel does, and stores q to the output and k or v to the token's cache slot (a
negative slot: padding, nothing stored). In a decode step this replaces two launches, the
rotary and the KV write, the second of which read what the first had just written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.ops.metadata import QKNorm
from loraplex.ops.triton.launch import pdl, wait_for_inputs
from loraplex.ops.triton.rotary import cos_sin_at, rotate_heads

# Head-halves a program: BLOCK_H x head_dim / 2 of about this many values.
HALF_VALUES = 256


@triton.jit
def _rotate_and_store_kernel(
    q_ptr, k_ptr, v_ptr, qo_ptr, kc_ptr, vc_ptr, pos_ptr, cs_ptr, qw_ptr, kw_ptr, eps, cache_slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_qot, stride_qoh,
    stride_cb, stride_cs, stride_ch, stride_cos,
    NUM_Q: tl.constexpr, NUM_K: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    t = tl.program_id(0)
    g = tl.program_id(1)
    HALF: tl.constexpr = HEAD_DIM // 2
    Q_GROUPS: tl.constexpr = (NUM_Q + BLOCK_H - 1) // BLOCK_H
    K_GROUPS: tl.constexpr = (NUM_K + BLOCK_H - 1) // BLOCK_H
    cos, sin = cos_sin_at(cs_ptr, tl.load(pos_ptr + t), stride_cos, q_ptr.dtype.element_ty, HALF, BLOCK_HALF)
    if g < Q_GROUPS:
        rotate_heads(q_ptr + t * stride_qt, stride_qh, qo_ptr + t * stride_qot, stride_qoh, g * BLOCK_H,
                     NUM_Q, cos, sin, qw_ptr, eps, HALF, BLOCK_H, BLOCK_HALF, NORM, UNIT_OFFSET, True)
    else:
        cache_slot = tl.load(cache_slot_ptr + t)
        if cache_slot >= 0:  # else a padding token: nothing to store
            at = (cache_slot // PAGE) * stride_cb + (cache_slot % PAGE) * stride_cs
            if g < Q_GROUPS + K_GROUPS:
                rotate_heads(k_ptr + t * stride_kt, stride_kh, kc_ptr + at, stride_ch,
                             (g - Q_GROUPS) * BLOCK_H, NUM_K, cos, sin, kw_ptr, eps, HALF, BLOCK_H,
                             BLOCK_HALF, NORM, UNIT_OFFSET, True)
            else:  # v: copied
                rotate_heads(v_ptr + t * stride_vt, stride_vh, vc_ptr + at, stride_ch,
                             (g - Q_GROUPS - K_GROUPS) * BLOCK_H, NUM_K, cos, sin, kw_ptr, eps, HALF, BLOCK_H,
                             BLOCK_HALF, False, False, False)


def rotate_and_store(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, qk_norm: QKNorm | None = None,
) -> torch.Tensor:
    """See loraplex.ops.rotate_and_store."""
    num_tokens, num_q, head_dim = q.shape
    num_k = k.shape[1]
    assert head_dim % 2 == 0 and k.shape == v.shape == (num_tokens, num_k, head_dim)
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    block_half = triton.next_power_of_2(head_dim // 2)
    block_h = max(1, min(triton.next_power_of_2(max(num_q, num_k)), HALF_VALUES // block_half))
    groups = triton.cdiv(num_q, block_h) + 2 * triton.cdiv(num_k, block_h)
    if num_tokens:
        _rotate_and_store_kernel[(num_tokens, groups)](
            q, k, v, q_out, k_cache, v_cache, positions, cos_sin,
            qk_norm.q_weight if qk_norm else cos_sin, qk_norm.k_weight if qk_norm else cos_sin,
            qk_norm.eps if qk_norm else 0.0, slot_mapping,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            q_out.stride(0), q_out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            cos_sin.stride(0),
            NUM_Q=num_q, NUM_K=num_k, HEAD_DIM=head_dim, PAGE=k_cache.shape[1],
            BLOCK_H=block_h, BLOCK_HALF=block_half,
            NORM=qk_norm is not None, UNIT_OFFSET=bool(qk_norm and qk_norm.unit_offset), num_warps=4,
            **pdl(),
        )
    return q_out
