"""LoRA shrink, segmented GEMM form (prefill): out[s, t, :r] = x[t] @ A[s, slot(t), :r].T,
tokens grouped by adapter slot.

Why this shape: a step's tokens arrive grouped by adapter (`LoRABatch`), so each program
takes BLOCK_M tokens of one group and multiplies them by that group's A: a segmented
GEMM (SGMV). In decode each group has a token or a few and the op is a skinny GEMV over
in_features (K = 4096+): split-K spreads that K over many programs, which atomically add
their fp32 partial sums. Only the group's own rank is read (masked columns of A are never
loaded), and all slices of a fused projection (q/k/v, gate/up) run in one launch.
Each program finds its (group, token block) on the device (`find_tile`), so the grid
depends only on the token count and max_loras, never on the adapter mix: one launch,
eager or captured in a CUDA graph, serves every batch composition.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.ops.metadata import LoRABatch
from loraplex.ops.triton.gemm_tiles import col_tile, row_tile
from loraplex.ops.triton.launch import pdl, wait_for_inputs
from loraplex.ops.triton.precision import dot_settings
from loraplex.ops.triton.segment_tiles import find_tile, max_tiles

# Tuned on H200 for Llama-3.1-8B prefill (benchmarks/prefill_lora.py; benchmarks/LOG.md).
BLOCK_M, BLOCK_K, NUM_WARPS = 32, 128, 4


def shrink_config(num_tokens: int, in_features: int) -> dict:
    """Few tokens (a small or graph-captured batch): one tile covers a group's tokens.
    Split-K spreads the long K over programs: a 2048-token step has only ~60 tiles, and
    one program walking all of down_proj's K = 14336 alone took 85 us where four take 26;
    at 8192 tokens there are tiles enough and two splits do best."""
    if num_tokens <= 64:
        return dict(BLOCK_M=max(16, triton.next_power_of_2(num_tokens)), BLOCK_K=128,
                    SPLIT_K=4, num_warps=4)
    return dict(BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, SPLIT_K=4 if num_tokens <= 4096 else 2,
                num_warps=NUM_WARPS)


@triton.jit(do_not_specialize=["K", "num_groups"])
def _lora_shrink_kernel(
    x_ptr, a_ptr, out_ptr,
    sorted_ids_ptr, group_slots_ptr, group_starts_ptr, group_ranks_ptr, num_groups,
    K,
    stride_xm, stride_xk,
    stride_as, stride_al, stride_ar, stride_ak,
    stride_os, stride_om, stride_or,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    pid_sk = tl.program_id(0)  # slice * SPLIT_K + k-split
    s = pid_sk // SPLIT_K
    k_split = pid_sk % SPLIT_K
    group, m0 = find_tile(tl.program_id(1), group_starts_ptr, num_groups, BLOCK_M)
    if group >= num_groups:
        return
    slot = tl.load(group_slots_ptr + group)
    if slot < 0:
        return
    end = tl.load(group_starts_ptr + group + 1)
    rank = tl.load(group_ranks_ptr + group)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < end
    tokens = tl.load(sorted_ids_ptr + offs_m, mask=m_mask, other=0)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    offs_k = tl.arange(0, BLOCK_K)

    x_rows = x_ptr + tokens[:, None] * stride_xm
    a_cols = a_ptr + s * stride_as + slot * stride_al + offs_r[None, :] * stride_ar

    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    k_chunk = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    for k0 in range(k_split * k_chunk, tl.minimum((k_split + 1) * k_chunk, K), BLOCK_K):
        k = k0 + offs_k
        x = row_tile(x_rows, k, K, m_mask, stride_xk, EVEN_K, UPCAST)
        a = col_tile(a_cols, k, K, r_mask, stride_ak, EVEN_K, UPCAST)
        acc += tl.dot(x, a, input_precision=DOT_PRECISION)

    out = out_ptr + s * stride_os + tokens[:, None] * stride_om + offs_r[None, :] * stride_or
    mask = m_mask[:, None] & r_mask[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc, mask=mask)
    else:
        tl.atomic_add(out, acc, mask=mask)


def lora_shrink_sgmv(x: torch.Tensor, lora_a: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
    num_slices, _, max_rank, in_features = lora_a.shape
    num_tokens = x.shape[0]
    assert x.shape[1] == in_features, (x.shape, lora_a.shape)
    assert x.dtype == lora_a.dtype, (x.dtype, lora_a.dtype)
    cfg = shrink_config(num_tokens, in_features)
    split_k = cfg["SPLIT_K"]
    out = (torch.zeros if split_k > 1 else torch.empty)(
        num_slices, num_tokens, max_rank, dtype=torch.float32, device=x.device
    )
    num_groups = batch.group_slots.shape[0]
    grid = (num_slices * split_k, max_tiles(num_tokens, num_groups, cfg["BLOCK_M"]))
    _lora_shrink_kernel[grid](
        x, lora_a, out,
        batch.sorted_token_ids, batch.group_slots, batch.group_starts, batch.group_ranks, num_groups,
        in_features,
        x.stride(0), x.stride(1),
        *lora_a.stride(),
        *out.stride(),
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_R=max(16, triton.next_power_of_2(max_rank)),
        BLOCK_K=cfg["BLOCK_K"],
        SPLIT_K=split_k,
        EVEN_K=in_features % cfg["BLOCK_K"] == 0,
        **dot_settings(x.dtype),
        num_warps=cfg["num_warps"],
        **pdl(),
    )
    return out
