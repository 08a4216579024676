"""The step both paged-attention kernels repeat: one tile of keys/values into the
online softmax."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_tile(
    q, m_i, l_i, acc, n, n_mask, visible, table, k_cache_ptr, v_cache_ptr, kv_head, offs_d, d_mask,
    stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd, scale,
    PAGE: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """Keys/values n (a BLOCK_N tile, n_mask: inside the range) read through the block
    table; q [BLOCK_M, D]; visible [BLOCK_M or 1, BLOCK_N]. Returns the updated running
    max, sum and unnormalised output (m_i, l_i, acc)."""
    page = tl.load(table + n // PAGE, mask=n_mask, other=0)
    k_off = page * stride_kb + (n % PAGE) * stride_ks + kv_head * stride_kh
    v_off = page * stride_vb + (n % PAGE) * stride_vs + kv_head * stride_vh
    k = tl.load(k_cache_ptr + k_off[None, :] + offs_d[:, None] * stride_kd,
                mask=n_mask[None, :] & d_mask[:, None], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_cache_ptr + v_off[:, None] + offs_d[None, :] * stride_vd,
                mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc
