"""kv_b_proj's adapter delta under absorption, for decode steps (mla_decode.py): two
kernels, one per side of the latent attention, each a program per (token, head block,
chunk of its output row) that reads its token's slot on the device (graph safe) and
returns at once for base tokens. A decode step has few tokens: the chunks are what
spreads the work over the SMs (each program recomputes the small rank-R middle).

    key side:   q_lat[t, h] += A_s^T (B_k[s, h]^T q_nope[t, h])      (before attention)
    value side: out[t, h]   += B_v[s, h] (A_s o_lat[t, h])            (after attention)

B differs per head, so the rank-R middle u[h] is a broadcast product summed over the
head's rows; A is shared by the heads, so the other product is one tl.dot over the block.
Both update their bf16 (or float32) target in place, the delta summed in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.ops.metadata import MLALoRA
from loraplex.ops.triton.launch import pdl, wait_for_inputs
from loraplex.ops.triton.precision import dot_settings

BLOCK_H = 16  # heads per program (tl.dot's least M)
BLOCK_IN = 32  # rows of B (a head's nope or v dims) per tile
BLOCK_LAT = 128  # latent dims per tile


def add_key_delta(q_lat: torch.Tensor, q_nope: torch.Tensor, lora: MLALoRA) -> None:
    """q_lat [T, H, r] += the key rows' adapter delta, per token's slot."""
    _launch(_key_delta, q_lat, q_nope, lora.b_k, lora, chunks=triton.cdiv(lora.a.shape[2], BLOCK_LAT))


def add_value_delta(out: torch.Tensor, o_lat: torch.Tensor, lora: MLALoRA) -> None:
    """out [T, H, v] += the value rows' adapter delta B_v (A o_lat), per token's slot."""
    _launch(_value_delta, out, o_lat, lora.b_v, lora, chunks=triton.cdiv(out.shape[2], BLOCK_IN))


def _launch(kernel, target: torch.Tensor, src: torch.Tensor, b: torch.Tensor, lora: MLALoRA, chunks: int):
    """kernel over (tokens, head blocks, chunks): target [T, H, .] += delta of src [T, H, .],
    through A [slots, R, r] and b [slots, H, rows, R] (its rows: nope or v)."""
    t, heads = target.shape[:2]
    a = lora.a
    assert all(x.stride(-1) == 1 for x in (target, src, a, b)), "rows must be contiguous"
    kernel[(t, triton.cdiv(heads, BLOCK_H), chunks)](
        target, src, a, b, lora.batch.token_slot,
        target.stride(0), target.stride(1), src.stride(0), src.stride(1),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2),
        heads, b.shape[2], a.shape[1], a.shape[2],
        R_PAD=max(16, triton.next_power_of_2(a.shape[1])), BLOCK_H=BLOCK_H, BLOCK_IN=BLOCK_IN,
        BLOCK_LAT=BLOCK_LAT, **dot_settings(a.dtype), num_warps=4, **pdl(),
    )


@triton.jit
def _program(token_slot, H, R, R_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
    """This program's token, its adapter slot (-1: none), its block of heads and the rank
    lanes, each with its mask."""
    t = tl.program_id(0)
    slot = tl.load(token_slot + t).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    k = tl.arange(0, R_PAD)
    return t, slot, heads, heads < H, k, k < R


@triton.jit
def _key_delta(q_lat, q_nope, a, b, token_slot, s_qt, s_qh, s_nt, s_nh, s_as, s_ar, s_bs, s_bh, s_bn,
               H, NOPE, R, LAT, R_PAD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_IN: tl.constexpr,
               BLOCK_LAT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
               PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    t, slot, heads, hmask, k, kmask = _program(token_slot, H, R, R_PAD, BLOCK_H)
    if slot < 0:
        return
    # u[h, k] = sum_n q_nope[t, h, n] B_k[s, h, n, k]
    u = tl.zeros([BLOCK_H, R_PAD], tl.float32)
    for n0 in range(0, NOPE, BLOCK_IN):
        n = n0 + tl.arange(0, BLOCK_IN)
        nmask = n < NOPE
        q = tl.load(q_nope + t * s_nt + heads[:, None] * s_nh + n[None, :],
                    mask=hmask[:, None] & nmask[None, :], other=0.0).to(tl.float32)
        rows = b + slot * s_bs + heads[:, None, None] * s_bh + n[None, :, None] * s_bn
        w = tl.load(rows + k[None, None, :],
                    mask=hmask[:, None, None] & nmask[None, :, None] & kmask[None, None, :],
                    other=0.0).to(tl.float32)
        u += tl.sum(q[:, :, None] * w, 1)
    # q_lat[t, h, r] += sum_k u[h, k] A[s, k, r], over this program's chunk of r
    r = tl.program_id(2) * BLOCK_LAT + tl.arange(0, BLOCK_LAT)
    rmask = r < LAT
    w = tl.load(a + slot * s_as + k[:, None] * s_ar + r[None, :], mask=kmask[:, None] & rmask[None, :],
                other=0.0)
    if UPCAST:
        w = w.to(tl.float32)
    delta = tl.dot(u.to(w.dtype), w, input_precision=DOT_PRECISION)
    ptrs = q_lat + t * s_qt + heads[:, None] * s_qh + r[None, :]
    mask = hmask[:, None] & rmask[None, :]
    new = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) + delta
    tl.store(ptrs, new.to(q_lat.dtype.element_ty), mask=mask)


@triton.jit
def _value_delta(out, o_lat, a, b, token_slot, s_ot, s_oh, s_lt, s_lh, s_as, s_ar, s_bs, s_bh, s_bv,
                 H, V, R, LAT, R_PAD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_IN: tl.constexpr,
                 BLOCK_LAT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    t, slot, heads, hmask, k, kmask = _program(token_slot, H, R, R_PAD, BLOCK_H)
    if slot < 0:
        return
    # u[h, k] = sum_r o_lat[t, h, r] A[s, k, r]
    u = tl.zeros([BLOCK_H, R_PAD], tl.float32)
    for r0 in range(0, LAT, BLOCK_LAT):
        r = r0 + tl.arange(0, BLOCK_LAT)
        rmask = r < LAT
        o = tl.load(o_lat + t * s_lt + heads[:, None] * s_lh + r[None, :],
                    mask=hmask[:, None] & rmask[None, :], other=0.0)
        w = tl.load(a + slot * s_as + k[:, None] * s_ar + r[None, :], mask=kmask[:, None] & rmask[None, :],
                    other=0.0)
        if UPCAST:
            o, w = o.to(tl.float32), w.to(tl.float32)
        u += tl.dot(o.to(w.dtype), tl.trans(w), input_precision=DOT_PRECISION)
    # out[t, h, v] += sum_k u[h, k] B_v[s, h, v, k], over this program's chunk of v
    v = tl.program_id(2) * BLOCK_IN + tl.arange(0, BLOCK_IN)
    vmask = v < V
    rows = b + slot * s_bs + heads[:, None, None] * s_bh + v[None, :, None] * s_bv
    bmask = hmask[:, None, None] & vmask[None, :, None] & kmask[None, None, :]
    w = tl.load(rows + k[None, None, :], mask=bmask, other=0.0).to(tl.float32)
    delta = tl.sum(u[:, None, :] * w, 2)
    ptrs = out + t * s_ot + heads[:, None] * s_oh + v[None, :]
    mask = hmask[:, None] & vmask[None, :]
    new = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) + delta
    tl.store(ptrs, new.to(out.dtype.element_ty), mask=mask)
