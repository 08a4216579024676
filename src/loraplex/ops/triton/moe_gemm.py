"""Grouped GEMM of the MoE experts over aligned pair blocks (moe_align.py):
out[pair, :] = A[row(pair)] @ W[expert(block)].T (+ bias[expert]) (+ delta[pair]).

Each program takes one block of BLOCK_M sorted pairs (all routed to one expert) and
BLOCK_N output columns. The gate/up GEMM gathers its rows straight from x (row = pair //
top_k: no per-expert copy of x); the down GEMM reads the [P, I] intermediate (row =
pair). Options: FUSE_ACT loads the gate tile and the matching up tile (W rows n and
n + I) and stores act(gate) * up, so the [P, 2I] output never exists; MUL_ROUTED_WEIGHT
scales each row by its routing weight before the store. With a LoRA delta (moe_lora.py:
the adapters' contribution per pair, written only for pairs whose token has an adapter
on these experts) the epilogue adds it to the fp32 accumulator of those rows before
the activation and the routing weight, so base and adapter output are rounded once
(moe_epilogue.py, shared with the quantized experts' GEMMs, moe_gemm_quant.py). fp32
accumulation; blocks past the valid count (worst-case grid) exit at once. Outputs are
indexed by pair.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from loraplex.ops.metadata import MoELoRA
from loraplex.ops.reference.moe import SWIGLU_OAI_ALPHA
from loraplex.ops.triton.gemm_tiles import col_tile, row_tile
from loraplex.ops.triton.launch import pdl, wait_for_inputs
from loraplex.ops.triton.moe_align import Alignment
from loraplex.ops.triton.moe_configs import tuned_config, weight_format
from loraplex.ops.triton.moe_epilogue import check_delta, operands_first, pair_operands, store_pairs
from loraplex.ops.triton.precision import dot_settings

# Untuned defaults by average pairs per expert (T * top_k / E): few rows make a GEMV
# bound by weight reads (small BLOCK_M wastes least padding, wide K steps), many rows
# a GEMM (larger tiles, grouped ordering so blocks of one expert share W in L2).
DEFAULT_CONFIGS = (
    (16, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)),
    (64, dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, GROUP_M=4, num_warps=4, num_stages=3)),
    (math.inf, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)),
)


# W8A8 experts (moe_gemm_quant.py): K steps of a whole 128-column scale block; each
# step's product is scaled before it joins the sum, so small tiles of 4 warps keep more
# of them in flight (Qwen3-30B-A3B's experts at 2,048 tokens, H100: 753 us a layer,
# against 1,063 with DEFAULT_CONFIGS' prefill tile).
W8A8_DEFAULT_CONFIGS = (
    (16, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)),
    (64, dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=4, num_warps=4, num_stages=3)),
    (math.inf, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3)),
)


# MXFP4 experts (moe_gemm_quant.py): blocks of at most 32 pairs. The e2m1 decode feeds
# mma.sync; a 64-pair block runs the same decode for more rows on wgmma-less tiles
# (gpt-oss-20b's experts at 2,048 tokens, H200: 6.06 ms against 1.57 dequantized first,
# which steps from moe_configs.DEQUANTIZE_MIN_PAIRS_PER_EXPERT take).
MXFP4_DEFAULT_CONFIGS = (
    (16, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)),
    (math.inf, dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, GROUP_M=4, num_warps=4, num_stages=3)),
)
_FORMAT_DEFAULTS = {"w8a8": W8A8_DEFAULT_CONFIGS, "mxfp4": MXFP4_DEFAULT_CONFIGS}


def default_configs(fmt: str | None) -> tuple:
    """The (pairs per expert limit, config) table a weight format (moe_configs.weight_format)
    takes where no tuned file holds its shape."""
    return _FORMAT_DEFAULTS.get(fmt, DEFAULT_CONFIGS)


def gemm_config(w: torch.Tensor, num_tokens: int, top_k: int) -> dict:
    """Tuned config for weight w [E, N, K] if a file exists, else the default table's."""
    tuned = tuned_config(w, num_tokens, top_k)
    if tuned is not None:
        return tuned
    rows = num_tokens * top_k / w.shape[0]
    table = default_configs(weight_format(w, num_tokens, top_k))
    return dict(next(cfg for limit, cfg in table if rows <= limit))


# N and K are specialized (fixed per model): their alignment makes the up half of W and of
# the delta (N columns on) loadable in 16-byte vectors.
@triton.jit(do_not_specialize=["num_pairs", "num_blocks", "limit"])
def _moe_gemm_kernel(
    a_ptr, w_ptr, bias_ptr, out_ptr, weights_ptr, delta_ptr, token_slot_ptr, slot_mask_ptr,
    sorted_ids_ptr, block_experts_ptr, num_valid_ptr,
    N, K, num_pairs, num_blocks, limit,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_be, stride_bn,
    stride_om, stride_on, stride_dm,
    ROW_DIV: tl.constexpr, HAS_BIAS: tl.constexpr, FUSE_ACT: tl.constexpr,
    HAS_DELTA: tl.constexpr, TOP_K: tl.constexpr, USE_SLOT_MASK: tl.constexpr,
    SPARSE_DELTA: tl.constexpr, OPERANDS_FIRST: tl.constexpr,
    ACTIVATION: tl.constexpr, ALPHA: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    # Grouped ordering: GROUP_M consecutive pair blocks sweep the column blocks together.
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * n_blocks)
    first_m = group * GROUP_M
    group_size = tl.minimum(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * n_blocks)) % group_size
    pid_n = (pid % (GROUP_M * n_blocks)) // group_size
    if pid_m * BLOCK_M >= tl.load(num_valid_ptr):
        return
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)

    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = pairs < num_pairs
    rows = (pairs // ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + rows[:, None] * stride_am
    w_cols = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn  # W.T tile [BLOCK_K, BLOCK_N]
    up_cols = w_cols + N * stride_wn  # FUSE_ACT: the up rows sit I = N rows below the gate's

    if OPERANDS_FIRST:  # no dependent loads among them: in flight during the main loop
        add, add_up, weight = pair_operands(expert, pairs, m_mask, offs_n, n_mask, N, bias_ptr, weights_ptr,
                                            delta_ptr, token_slot_ptr, slot_mask_ptr, stride_be, stride_bn,
                                            stride_dm, HAS_BIAS, FUSE_ACT, HAS_DELTA, TOP_K, USE_SLOT_MASK,
                                            MUL_ROUTED_WEIGHT, EVEN_N, SPARSE_DELTA=SPARSE_DELTA)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        a = row_tile(a_rows, k, K, m_mask, stride_ak, EVEN_K, UPCAST)
        w = col_tile(w_cols, k, K, n_mask, stride_wk, EVEN_K, UPCAST)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
        if FUSE_ACT:
            u = col_tile(up_cols, k, K, n_mask, stride_wk, EVEN_K, UPCAST)
            acc_up += tl.dot(a, u, input_precision=DOT_PRECISION)

    if not OPERANDS_FIRST:
        add, add_up, weight = pair_operands(expert, pairs, m_mask, offs_n, n_mask, N, bias_ptr, weights_ptr,
                                            delta_ptr, token_slot_ptr, slot_mask_ptr, stride_be, stride_bn,
                                            stride_dm, HAS_BIAS, FUSE_ACT, HAS_DELTA, TOP_K, USE_SLOT_MASK,
                                            MUL_ROUTED_WEIGHT, EVEN_N, SPARSE_DELTA=SPARSE_DELTA)
    store_pairs(acc, acc_up, add, add_up, weight, pairs, m_mask, offs_n, n_mask, limit, out_ptr, stride_om,
                stride_on, FUSE_ACT, ACTIVATION, ALPHA, MUL_ROUTED_WEIGHT, EVEN_N)


def moe_gemm(
    a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
    align: Alignment, cfg: dict, row_div: int, activation: str | None = None,
    limit: float = math.inf, routed_weights: torch.Tensor | None = None,
    delta: torch.Tensor | None = None, lora: MoELoRA | None = None, top_k: int = 1,
) -> None:
    """out[pair] = A[pair // row_div] @ W[e].T (+ bias[e]) for the pairs of `align`;
    with `activation`, out [P, N / 2] = act(gate) * up; with routed_weights (float32,
    contiguous [T, top_k]), rows scaled by their routing weight. a [rows, K]; w [E, N, K].
    With delta [P, N], delta[pair] joins the product before the activation and the
    weight: with `lora`, only at pairs whose token (p // top_k) has an adapter on these
    experts (the rows the aligned expert-LoRA kernel writes); without, at every pair."""
    assert cfg["BLOCK_M"] == align.block_m, (cfg, align.block_m)
    n = w.shape[1] // 2 if activation else w.shape[1]
    assert a.shape[1] == w.shape[2] and out.shape == (align.num_pairs, n), (a.shape, w.shape, out.shape)
    assert a.dtype == w.dtype, (a.dtype, w.dtype)
    if routed_weights is not None:
        assert routed_weights.dtype == torch.float32 and routed_weights.is_contiguous()
    check_delta(delta, lora, None, align.num_pairs, w.shape[0], w.shape[1])
    grid = (align.num_blocks * triton.cdiv(n, cfg["BLOCK_N"]),)
    _moe_gemm_kernel[grid](
        a, w, bias if bias is not None else w, out, routed_weights if routed_weights is not None else w,
        delta if delta is not None else w, lora.token_slot if lora is not None else w,
        lora.slot_mask if lora is not None and lora.slot_mask is not None else w,
        align.sorted_ids, align.block_groups, align.num_valid,
        n, w.shape[2], align.num_pairs, align.num_blocks, limit,
        *a.stride(), *w.stride(), *(bias.stride() if bias is not None else (0, 0)), *out.stride(),
        delta.stride(0) if delta is not None else 0,
        ROW_DIV=row_div, HAS_BIAS=bias is not None, FUSE_ACT=activation is not None,
        HAS_DELTA=delta is not None, TOP_K=top_k,
        USE_SLOT_MASK=lora is not None and lora.slot_mask is not None,
        SPARSE_DELTA=lora is not None,
        OPERANDS_FIRST=operands_first(delta is not None and lora is not None, cfg["BLOCK_M"]),
        ACTIVATION=activation or "none", ALPHA=SWIGLU_OAI_ALPHA,
        MUL_ROUTED_WEIGHT=routed_weights is not None,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
        EVEN_K=w.shape[2] % cfg["BLOCK_K"] == 0, EVEN_N=n % cfg["BLOCK_N"] == 0, **dot_settings(w.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **pdl(),
    )
