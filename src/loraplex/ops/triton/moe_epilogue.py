"""The epilogue of the MoE expert GEMMs (moe_gemm.py, moe_gemm_quant.py, moe_gemv_quant.py):
float32 accumulators of some pairs' output columns -> the stored output rows.

In order: + bias[expert]; + the adapter delta of pairs whose token has an adapter on
these experts (moe_lora*.py wrote those rows only); the gated activation (FUSE_ACT:
acc holds the gate columns, acc_up the matching up columns, N on); the routing weight
(MUL_ROUTED_WEIGHT); one rounding to the output's dtype. Base and adapter output are
thus rounded once, after the activation and the weight, as the reference computes them.

`pair_operands` loads what the epilogue adds and multiplies, `store_pairs` finishes and
stores; in the GEMV form (moe_gemv_quant.py) the first also expands each pair's shrunk
adapter row at its columns (LORA_EXPAND). Where a delta holds rows only for pairs of
tokens with an adapter (SPARSE_DELTA: the aligned expert-LoRA kernel writes those
alone), each pair's slot, then the slot's mask, then the row are three dependent loads:
the grouped GEMMs load them after the main loop (issued before it, the Qwen3-30B-A3B FP8
decode graph with 16 adapters took 13.54-13.67 ms against 12.80-12.96 on an H100: a warp
issues in order, so the chain stalls it there just the same). Operands with no chain
(bias, routing weights, a delta written for every pair: the GEMV-form kernel's) are
loaded before the loop in decode-sized tiles (`operands_first`), so they arrive while
it runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.ops.triton.moe_act import gated_act

# The grouped GEMMs load chain-free epilogue operands before their main loop in tiles of
# up to this many pairs (decode steps, where it was timed; a prompt step's 64-row tiles
# would hold 6-16 more registers a thread through the loop, untimed). A switch for
# benchmarks: False loads them after it, as sparse deltas are.
OPERANDS_BEFORE_LOOP = True
OPERANDS_FIRST_MAX_BLOCK_M = 16


def operands_first(sparse_delta: bool, block_m: int) -> bool:
    """Whether a grouped GEMM with tiles of block_m pairs loads its epilogue operands before
    its main loop: where no slot -> mask -> delta chain is among them."""
    return OPERANDS_BEFORE_LOOP and not sparse_delta and block_m <= OPERANDS_FIRST_MAX_BLOCK_M


@triton.jit
def pair_operands(
    expert, pairs, m_mask, offs_n, n_mask, N,
    bias_ptr, weights_ptr, delta_ptr, token_slot_ptr, slot_mask_ptr,
    stride_be, stride_bn, stride_dm,
    HAS_BIAS: tl.constexpr, FUSE_ACT: tl.constexpr, HAS_DELTA: tl.constexpr, TOP_K: tl.constexpr,
    USE_SLOT_MASK: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, EVEN_N: tl.constexpr,
    lora_b_ptr=None, stride_lbl=0, stride_lbe=0, stride_lbn=0, R: tl.constexpr = 1, BLOCK_R: tl.constexpr = 1,
    LORA_EXPAND: tl.constexpr = False, SPARSE_DELTA: tl.constexpr = True,
):
    """What store_pairs adds to and multiplies the accumulators of pairs [M] (m_mask: real
    ones), all routed to `expert`, at output columns offs_n [BLOCK_N]: (add, add_up,
    weight), add and add_up [M, BLOCK_N] float32 (bias + delta; add_up: the up columns',
    read with FUSE_ACT), weight [M] float32 (the routing weight, or 1).
    SPARSE_DELTA: delta rows exist for pairs of tokens in a slot (>= 0, and set in
    slot_mask with USE_SLOT_MASK) only; otherwise every pair's row is read.
    LORA_EXPAND (with SPARSE_DELTA): delta_ptr holds each pair's shrunk row [R] instead of
    its delta, and the delta at these columns is expanded here, from the rows of B [L, E,
    N(x2), R] at lora_b_ptr (a gather of [M, BLOCK_N, R]: for one-pair tiles, the GEMV
    form)."""
    add = tl.zeros((pairs.shape[0], offs_n.shape[0]), dtype=tl.float32)
    add_up = tl.zeros((pairs.shape[0], offs_n.shape[0]), dtype=tl.float32)
    if HAS_BIAS:
        bias = bias_ptr + expert * stride_be + offs_n * stride_bn
        add += tl.load(bias, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if FUSE_ACT:
            add_up += tl.load(bias + N * stride_bn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_DELTA:
        covered = m_mask
        if SPARSE_DELTA:  # rows of tokens with an adapter on these experts (as align_lora keeps)
            slot = tl.load(token_slot_ptr + pairs // TOP_K, mask=m_mask, other=-1)
            covered &= slot >= 0
            if USE_SLOT_MASK:
                covered &= tl.load(slot_mask_ptr + slot, mask=covered, other=0) != 0
        if LORA_EXPAND:
            r = tl.arange(0, BLOCK_R)
            shrunk = tl.load(delta_ptr + pairs.to(tl.int64)[:, None] * stride_dm + r[None, :],
                             mask=covered[:, None] & (r < R)[None, :], other=0.0)[:, None, :]
            b_mask = covered[:, None, None] & (r < R)[None, None, :]
            if not EVEN_N:
                b_mask &= n_mask[None, :, None]
            b = (lora_b_ptr + slot.to(tl.int64)[:, None, None] * stride_lbl + expert * stride_lbe
                 + offs_n[None, :, None] * stride_lbn + r[None, None, :])
            add += tl.sum(tl.load(b, mask=b_mask, other=0.0).to(tl.float32) * shrunk, axis=2)
            if FUSE_ACT:
                up = tl.load(b + N * stride_lbn, mask=b_mask, other=0.0).to(tl.float32)
                add_up += tl.sum(up * shrunk, axis=2)
        else:
            d_mask = covered[:, None] if EVEN_N else covered[:, None] & n_mask[None, :]
            d = delta_ptr + pairs.to(tl.int64)[:, None] * stride_dm + offs_n[None, :]
            add += tl.load(d, mask=d_mask, other=0.0).to(tl.float32)
            if FUSE_ACT:
                add_up += tl.load(d + N, mask=d_mask, other=0.0).to(tl.float32)
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(weights_ptr + pairs, mask=m_mask, other=0.0).to(tl.float32)
    else:
        weight = tl.full((pairs.shape[0],), 1.0, dtype=tl.float32)
    return add, add_up, weight


@triton.jit
def store_pairs(
    acc, acc_up, add, add_up, weight, pairs, m_mask, offs_n, n_mask, limit, out_ptr, stride_om, stride_on,
    FUSE_ACT: tl.constexpr, ACTIVATION: tl.constexpr, ALPHA: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr, EVEN_N: tl.constexpr,
):
    """acc, acc_up [M, BLOCK_N] float32 (acc_up read only with FUSE_ACT) of pairs [M] at
    output columns offs_n, with pair_operands' (add, add_up, weight) -> the output rows."""
    acc += add
    if FUSE_ACT:
        acc = gated_act(acc, acc_up + add_up, limit, ACTIVATION, ALPHA)
    if MUL_ROUTED_WEIGHT:
        acc *= weight[:, None]
    out = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    if EVEN_N:  # rows alone masked: 16-byte stores (a mask against the runtime N splits them)
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def check_delta(delta, lora, lora_b, num_pairs: int, num_experts: int, n_w: int) -> None:
    """An expert GEMM's delta: whole rows [P, n_w] (with `lora`: rows of pairs whose token
    has an adapter on these experts alone, SPARSE_DELTA; without: every pair's), or
    (lora_b [L, E, n_w, R] and lora given: the GEMV form, LORA_EXPAND) each pair's shrunk
    row, float32 [P, R], that the epilogue expands."""
    if delta is None:
        assert lora_b is None
        return
    width = lora_b.shape[3] if lora_b is not None else n_w
    assert lora is not None or lora_b is None
    assert delta.shape == (num_pairs, width) and delta.stride(1) == 1, delta.shape
    if lora_b is not None:
        assert delta.dtype == torch.float32 and lora_b.shape[1:3] == (num_experts, n_w), lora_b.shape
        assert lora_b.stride(3) == 1, lora_b.stride()
