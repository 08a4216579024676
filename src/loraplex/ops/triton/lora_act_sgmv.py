"""LoRA expand of the gate/up projection fused into the gated activation, segmented GEMM
form (steps with prefill): out[t, n] = act(g + dg) * (u + du) for every token t, with
[dg | du] = buf[:, t, :r] @ B[slot(t), (n, I + n), :r].T where t has an adapter.

Tiles of up to TILE_BLOCKS x BLOCK_M tokens of one adapter group (tokens sorted by slot,
as the expand) by BLOCK_N columns of the intermediate size I; after the groups come tiles
of the tokens without an adapter, which only activate. An adapter tile computes its delta
on the tensor cores from the group's shrunk rows and B (loaded once per program), adds it
to the gate and up tiles it reads anyway, and writes the activation: the projection's
output ([T, 2I], the largest activation of the layer) is read once, where expand +
activation read it twice and wrote it once more.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.ops.metadata import LoRABatch
from loraplex.ops.triton.activation import gated_act
from loraplex.ops.triton.launch import pdl, wait_for_inputs
from loraplex.ops.triton.lora_common import gated_output, rank_ceil
from loraplex.ops.triton.precision import dot_settings
from loraplex.ops.triton.segment_tiles import find_tile_or_tail, max_tiles


def act_config(num_tokens: int) -> dict:
    """16-token blocks as the expand SGMV (a mixed step's decode tokens are one-token
    groups); a program walks TILE_BLOCKS of them with its B tiles loaded once."""
    return dict(BLOCK_M=16, BLOCK_N=128, TILE_BLOCKS=8, num_warps=4)


@triton.jit(do_not_specialize=["num_groups", "num_tokens"])
def _lora_act_sgmv_kernel(
    gu_ptr, buf_ptr, b_ptr, out_ptr,
    sorted_ids_ptr, group_slots_ptr, group_starts_ptr, group_ranks_ptr, num_groups, num_tokens,
    width, stride_gm, stride_bs, stride_bm, stride_wl, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, TILE_BLOCKS: tl.constexpr,
    GELU: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    span = BLOCK_M * TILE_BLOCKS
    group, m0 = find_tile_or_tail(tl.program_id(1), group_starts_ptr, num_groups, num_tokens, span)
    if group > num_groups:
        return
    # The tail (tokens without an adapter) runs the same code with rank 0: every LoRA load
    # is masked off and the delta is an exact 0.
    end = tl.minimum(num_tokens, m0 + span)
    slot = 0
    rank = 0
    if group < num_groups:
        end = tl.minimum(tl.load(group_starts_ptr + group + 1), m0 + span)
        slot = tl.maximum(tl.load(group_slots_ptr + group), 0)
        rank = tl.load(group_ranks_ptr + group)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < width
    r = tl.arange(0, BLOCK_R)
    # [R, N] tiles of B, zero past the rank in every slot: whole vectors up to rank_ceil.
    w_mask = (r < rank_ceil(rank))[:, None] & n_mask[None, :]
    w = b_ptr + slot * stride_wl + n[None, :] * stride_wn + r[:, None]
    w_gate = tl.load(w, mask=w_mask, other=0.0)
    w_up = tl.load(w + width * stride_wn, mask=w_mask, other=0.0)
    if UPCAST:
        w_gate = w_gate.to(tl.float32)
        w_up = w_up.to(tl.float32)
    for mb in range(m0, end, BLOCK_M):
        offs_m = mb + tl.arange(0, BLOCK_M)
        m_mask = offs_m < end
        tokens = tl.load(sorted_ids_ptr + offs_m, mask=m_mask, other=0)
        mask = m_mask[:, None] & n_mask[None, :]
        row = gu_ptr + tokens[:, None] * stride_gm + n[None, :]
        gate = tl.load(row, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(row + width, mask=mask, other=0.0).to(tl.float32)
        x_mask = m_mask[:, None] & (r < rank)[None, :]
        x = buf_ptr + tokens[:, None] * stride_bm + r[None, :]
        x_gate = tl.load(x, mask=x_mask, other=0.0)
        x_up = tl.load(x + stride_bs, mask=x_mask, other=0.0)
        gate += tl.dot(x_gate.to(w_gate.dtype), w_gate, input_precision=DOT_PRECISION)
        up += tl.dot(x_up.to(w_up.dtype), w_up, input_precision=DOT_PRECISION)
        # Rounded as the unfused path stored them: the same tokens, bit for bit.
        gate = gate.to(gu_ptr.dtype.element_ty).to(tl.float32)
        up = up.to(gu_ptr.dtype.element_ty).to(tl.float32)
        out = gated_act(gate, GELU) * up
        tl.store(out_ptr + tokens[:, None] * stride_om + n[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=mask)


def lora_act_sgmv(gate_up: torch.Tensor, buf: torch.Tensor, lora_b: torch.Tensor,
                  batch: LoRABatch, activation: str) -> torch.Tensor:
    out = gated_output(gate_up, buf, lora_b)
    num_tokens, width = out.shape
    num_groups = batch.group_slots.shape[0]
    cfg = act_config(num_tokens)
    span = cfg["BLOCK_M"] * cfg["TILE_BLOCKS"]
    grid = (triton.cdiv(width, cfg["BLOCK_N"]), max_tiles(num_tokens, num_groups + 1, span))
    _lora_act_sgmv_kernel[grid](
        gate_up, buf, lora_b, out,
        batch.sorted_token_ids, batch.group_slots, batch.group_starts, batch.group_ranks,
        num_groups, num_tokens, width,
        gate_up.stride(0), buf.stride(0), buf.stride(1), lora_b.stride(0), lora_b.stride(1),
        out.stride(0),
        BLOCK_R=max(16, triton.next_power_of_2(buf.shape[2])), GELU=activation == "gelu_tanh",
        **dot_settings(lora_b.dtype), **cfg,
        **pdl(),
    )
    return out
