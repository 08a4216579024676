"""LoRA expand of the gate/up projection fused into the gated activation, decode form:
out[t, n] = act(g + dg) * (u + du), [dg | du] = buf[:, t, :r] @ B[slot(t), (n, I + n), :r].T.

One program per (token, BLOCK_N columns of the intermediate size I), as the expand GEMV:
it reads the token's gate and up columns, adds its adapter's delta reduced in registers,
and writes the activation. The unfused path added the delta into the projection's output
in one launch and read it again in the next; here the delta never leaves registers.
Tokens without an adapter only activate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.ops.metadata import LoRABatch
from loraplex.ops.triton.activation import gated_act
from loraplex.ops.triton.launch import pdl, wait_for_inputs
from loraplex.ops.triton.lora_common import gated_output, rank_ceil

# As the expand GEMV (benchmarks/kernels.py): B blocks of 256 rows x r.
BLOCK_N = 256


@triton.jit
def _lora_act_gemv_kernel(
    gu_ptr, buf_ptr, b_ptr, out_ptr, token_slot_ptr, slot_ranks_ptr, width,
    stride_gm, stride_bs, stride_bm, stride_wl, stride_wn, stride_om,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, GELU: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    t = tl.program_id(1)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < width
    gate = tl.load(gu_ptr + t * stride_gm + n, mask=n_mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + t * stride_gm + width + n, mask=n_mask, other=0.0).to(tl.float32)
    slot = tl.load(token_slot_ptr + t)
    if slot >= 0:
        rank = tl.load(slot_ranks_ptr + slot)
        r = tl.arange(0, BLOCK_R)
        v_gate = tl.load(buf_ptr + t * stride_bm + r, mask=r < rank, other=0.0)
        v_up = tl.load(buf_ptr + stride_bs + t * stride_bm + r, mask=r < rank, other=0.0)
        # B is zero past the rank in every slot: whole 16-byte vectors up to rank_ceil.
        w_mask = n_mask[:, None] & (r < rank_ceil(rank))[None, :]
        w = b_ptr + slot * stride_wl + n[:, None] * stride_wn + r[None, :]
        w_gate = tl.load(w, mask=w_mask, other=0.0)
        w_up = tl.load(w + width * stride_wn, mask=w_mask, other=0.0)
        gate += tl.sum(w_gate.to(tl.float32) * v_gate[None, :], axis=1)
        up += tl.sum(w_up.to(tl.float32) * v_up[None, :], axis=1)
        # Rounded as the unfused path stored them: the same tokens, bit for bit.
        gate = gate.to(gu_ptr.dtype.element_ty).to(tl.float32)
        up = up.to(gu_ptr.dtype.element_ty).to(tl.float32)
    out = gated_act(gate, GELU) * up
    tl.store(out_ptr + t * stride_om + n, out.to(out_ptr.dtype.element_ty), mask=n_mask)


def lora_act_gemv(gate_up: torch.Tensor, buf: torch.Tensor, lora_b: torch.Tensor,
                  batch: LoRABatch, activation: str) -> torch.Tensor:
    out = gated_output(gate_up, buf, lora_b)
    num_tokens, width = out.shape
    block_n = min(BLOCK_N, triton.next_power_of_2(width))
    _lora_act_gemv_kernel[(triton.cdiv(width, block_n), num_tokens)](
        gate_up, buf, lora_b, out, batch.token_slot, batch.slot_ranks, width,
        gate_up.stride(0), buf.stride(0), buf.stride(1), lora_b.stride(0), lora_b.stride(1),
        out.stride(0),
        BLOCK_N=block_n, BLOCK_R=triton.next_power_of_2(buf.shape[2]),
        GELU=activation == "gelu_tanh", num_warps=4,
        **pdl(),
    )
    return out
