"""The epilogue of the MoE expert GEMMs (moe_gemm.py, moe_gemm_quant.py, moe_gemv_quant.py):
float32 accumulators of some pairs' output columns -> the stored output rows.

In order: + bias[expert]; + the adapter delta of pairs whose token has an adapter on
these experts (moe_lora*.py wrote those rows only); the gated activation (FUSE_ACT:
acc holds the gate columns, acc_up the matching up columns, N on); the routing weight
(MUL_ROUTED_WEIGHT); one rounding to the output's dtype. Base and adapter output are
thus rounded once, after the activation and the weight, as the reference computes them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from loraplex.ops.triton.moe_act import gated_act


@triton.jit
def store_pairs(
    acc, acc_up, expert, pairs, m_mask, offs_n, n_mask, N, limit,
    bias_ptr, out_ptr, weights_ptr, delta_ptr, token_slot_ptr, slot_mask_ptr,
    stride_be, stride_bn, stride_om, stride_on, stride_dm,
    HAS_BIAS: tl.constexpr, FUSE_ACT: tl.constexpr, HAS_DELTA: tl.constexpr, TOP_K: tl.constexpr,
    USE_SLOT_MASK: tl.constexpr, ACTIVATION: tl.constexpr, ALPHA: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr, EVEN_N: tl.constexpr,
):
    """acc, acc_up [M, BLOCK_N] float32 (acc_up read only with FUSE_ACT) of pairs [M]
    (m_mask: real ones), all routed to `expert`, at output columns offs_n [BLOCK_N]."""
    if HAS_BIAS:
        bias = bias_ptr + expert * stride_be + offs_n * stride_bn
        acc += tl.load(bias, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if FUSE_ACT:
            acc_up += tl.load(bias + N * stride_bn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_DELTA:  # rows of tokens with an adapter on these experts (as align_lora keeps)
        slot = tl.load(token_slot_ptr + pairs // TOP_K, mask=m_mask, other=-1)
        covered = m_mask & (slot >= 0)
        if USE_SLOT_MASK:
            covered &= tl.load(slot_mask_ptr + slot, mask=covered, other=0) != 0
        d_mask = covered[:, None] if EVEN_N else covered[:, None] & n_mask[None, :]
        d = delta_ptr + pairs.to(tl.int64)[:, None] * stride_dm + offs_n[None, :]
        acc += tl.load(d, mask=d_mask, other=0.0).to(tl.float32)
        if FUSE_ACT:
            acc_up += tl.load(d + N, mask=d_mask, other=0.0).to(tl.float32)
    if FUSE_ACT:
        acc = gated_act(acc, acc_up, limit, ACTIVATION, ALPHA)
    if MUL_ROUTED_WEIGHT:
        acc *= tl.load(weights_ptr + pairs, mask=m_mask, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    if EVEN_N:  # rows alone masked: 16-byte stores (a mask against the runtime N splits them)
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])
