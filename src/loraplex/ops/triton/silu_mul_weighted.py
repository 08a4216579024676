"""MoE training: silu(gate) * up * routing weight, forward and backward, one pass each.

Row i of the expert-sorted rows is flat pair order[i] (token * top_k + j): its weight is
weight[order[i]], and the weight's gradient goes back to that position (a permutation:
no two rows share one), so the router's [T, top_k] weights need no gather or scatter op.

The expert rows of a step are [P, 2I] (P = tokens x top_k: 131K rows at 16K tokens on
Qwen3-30B-A3B). Eager torch runs this as silu, mul, mul forward and five kernels plus a
cat backward, each a full pass over [P, I]; these read gate_up (and the gradient) once
and write once. Backward writes d gate_up in the [P, 2I] layout the gate/up projection's
backward takes, and the weight's gradient (a row sum, float32) in the same pass. With
`pad`, either output's rows have pad more columns that the kernels leave to the caller (a
folded projection's LoRA intermediate goes there: train/expert_gemm.py, FoldedStack).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.ops.triton.launch import pdl, wait_for_inputs

ROWS = 8  # rows per program; columns in blocks of up to 1024, looped


@triton.jit
def _row_block(order_ptr, w_ptr, n_rows, ROWS: tl.constexpr):
    """This program's rows, their mask, their flat pair index and routing weight."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    pair = tl.load(order_ptr + rows, mask=row_ok, other=0)
    w = tl.load(w_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
    return rows, row_ok, pair, w


@triton.jit
def _gate_up_tile(gu_ptr, rows, row_ok, start, width, stride_gu, BLOCK: tl.constexpr):
    """Columns [start, start + BLOCK) of gate and up for the rows, in float32, with the
    tile's mask and its offsets in gate_up (up sits `width` further on)."""
    cols = start + tl.arange(0, BLOCK)
    m = row_ok[:, None] & (cols < width)[None, :]
    at = rows[:, None] * stride_gu + cols[None, :]
    gate = tl.load(gu_ptr + at, mask=m, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + at + width, mask=m, other=0.0).to(tl.float32)
    return cols, m, at, gate, up


@triton.jit
def _forward_kernel(gu_ptr, w_ptr, order_ptr, out_ptr, n_rows, width, stride_gu, stride_o,
                    ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    rows, row_ok, pair, w = _row_block(order_ptr, w_ptr, n_rows, ROWS)
    for start in range(0, width, BLOCK):
        cols, m, at, gate, up = _gate_up_tile(gu_ptr, rows, row_ok, start, width, stride_gu, BLOCK)
        h = gate / (1.0 + tl.exp(-gate)) * up * w[:, None]
        tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], h.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _backward_kernel(g_ptr, gu_ptr, w_ptr, order_ptr, dgu_ptr, dw_ptr, n_rows, width, stride_g, stride_gu,
                     stride_dgu, ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    rows, row_ok, pair, w = _row_block(order_ptr, w_ptr, n_rows, ROWS)
    dw = tl.zeros([ROWS], dtype=tl.float32)
    for start in range(0, width, BLOCK):
        cols, m, at, gate, up = _gate_up_tile(gu_ptr, rows, row_ok, start, width, stride_gu, BLOCK)
        g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=m, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-gate))
        silu = gate * sig
        dw += tl.sum(g * silu * up, axis=1)
        gw = g * w[:, None]
        d_gate = gw * up * sig * (1.0 + gate * (1.0 - sig))
        d_at = rows[:, None] * stride_dgu + cols[None, :]
        tl.store(dgu_ptr + d_at, d_gate.to(dgu_ptr.dtype.element_ty), mask=m)
        tl.store(dgu_ptr + d_at + width, (gw * silu).to(dgu_ptr.dtype.element_ty), mask=m)
    tl.store(dw_ptr + pair, dw.to(dw_ptr.dtype.element_ty), mask=row_ok)


def _block(width: int) -> int:
    """Column block: a power of two that divides the width where one of 128+ does (768 ->
    256: no masked lanes), else the width rounded up (at most 1024, looped)."""
    for block in (1024, 512, 256, 128):
        if width % block == 0:
            return block
    return min(1024, triton.next_power_of_2(width))


def silu_mul_weighted(gate_up: torch.Tensor, weight: torch.Tensor, order: torch.Tensor,
                      pad: int = 0) -> torch.Tensor:
    n, width = gate_up.shape[0], gate_up.shape[1] // 2
    assert gate_up.stride(1) == 1 and weight.is_contiguous() and order.is_contiguous()
    out = gate_up.new_empty(n, width + pad)  # the pad columns are the caller's
    _forward_kernel[(triton.cdiv(n, ROWS),)](gate_up, weight, order, out, n, width, gate_up.stride(0),
                                             out.stride(0), ROWS=ROWS, BLOCK=_block(width), num_warps=4,
                                             **pdl())
    return out


def silu_mul_weighted_backward(grad: torch.Tensor, gate_up: torch.Tensor, weight: torch.Tensor,
                               order: torch.Tensor, pad: int = 0):
    n, width = gate_up.shape[0], gate_up.shape[1] // 2
    assert gate_up.stride(1) == 1 and grad.stride(1) == 1 and weight.is_contiguous() and order.is_contiguous()
    d_gate_up = gate_up.new_empty(n, 2 * width + pad)
    d_weight = torch.empty_like(weight)
    _backward_kernel[(triton.cdiv(n, ROWS),)](grad, gate_up, weight, order, d_gate_up, d_weight, n, width,
                                              grad.stride(0), gate_up.stride(0), d_gate_up.stride(0),
                                              ROWS=ROWS, BLOCK=_block(width), num_warps=4, **pdl())
    return d_gate_up, d_weight
