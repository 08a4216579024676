"""Quantized MoE experts (MXFP4, FP8 block-scaled) for decode-sized steps, GEMV form: one
program per (pair, BLOCK_N output columns), out[pair, :] = A[pair // row_div] @
dequantize(W)[expert(pair)].T (+ bias) (+ delta), with the grouped GEMM's options and
epilogue (moe_epilogue.py: activation, routing weight, LoRA delta). With adapters each
program expands its pair's shrunk adapter row at its own columns (the B rows of a
[BLOCK_N, R] tile, next to the weight's [BLOCK_N, K]), so the expert-LoRA kernel in
front of it stops at the shrink (fused_moe.GEMV_EXPANDS_LORA; Qwen3-30B-A3B FP8 decode
graph at 16 in flight with 16 adapters 12.96 -> 12.80 ms, H100).

In a decode step most experts hit serve one pair or none (gpt-oss-20b: 4 of 32 per
token); the grouped GEMM (moe_gemm_quant.py) would then run 16-row MMA tiles with one
row in use, behind the expert alignment, and convert each dequantized tile to the MMA's
operand layout. Here each program reads its pair's expert id straight from topk_ids (no
alignment), streams its rows' quantized bytes once, dequantizes them in registers
(quant_tiles.py: the values dequantize gives, rounded to the activations' dtype) and
multiplies them with the activation row in float32 FMAs, accumulated elementwise and
reduced once (bf16 MXFP4 on a GPU decodes in PTX: quant_tiles.mxfp4_bf16_cols, as the
grouped GEMM's decode-sized blocks do). FP8 with block scales takes each step's e4m3
values as they are, sums their products with x over the step and multiplies the sums
by the step's scales: the exact products of the stored weights, rounded once at the end
(within bf16 rounding of dequantize-then-multiply; a one-hot row reads dequantize's
values back exactly). Experts hit by several pairs are read once per pair (from L2 after the
first): fused_moe.py takes this form only while the step's pairs are no more than the
experts. The grid depends on the pair count alone (CUDA graphs).

Oracle: ops.reference.moe.fused_experts with the same QuantizedWeight.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from loraplex.ops.formats import Fp8Weight, QuantizedWeight
from loraplex.ops.metadata import MoELoRA
from loraplex.ops.reference.moe import SWIGLU_OAI_ALPHA
from loraplex.ops.triton.launch import pdl, wait_for_inputs
from loraplex.ops.triton.moe_epilogue import check_delta, pair_operands, store_pairs
from loraplex.ops.triton.precision import INTERPRETED
from loraplex.ops.triton.quant_tiles import (
    format_args,
    fp8_cols,
    mxfp4_bf16_cols,
    mxfp4_cols,
    mxfp4_path,
    mxfp4_scales,
    operand,
)

# MXFP4 (and FP8 with a scale per value): [BLOCK_K, BLOCK_N] float32 accumulators, two
# with the fused activation, reduced once at the end. FP8 with a scale per step (block
# scales, K steps inside one block) sums each step's products over K first and scales
# the [BLOCK_N] sums: a conversion and an FMA per value, against the conversion, the
# scale, the rounding to bf16 and the FMA of the elementwise form, and [BLOCK_N]
# accumulators instead of [BLOCK_K, BLOCK_N] (more programs resident). Qwen3-30B-A3B at
# 16 tokens (128 pairs, ~78 experts hit), H100, CUDA-graph replays: gate/up 137.6 us at
# its best elementwise config (8 warps) -> 103.0 at BLOCK_N 32, 4 warps; down 70.6 ->
# 50.1 at BLOCK_N 128, 8 warps (their bytes alone: 73 and 37 us). Sweeps:
# `benchmarks/LOG.md`, "FP8 expert GEMV configs" and "FP8 GEMV: sums per scale step".
GEMV_CONFIG = dict(BLOCK_N=32, BLOCK_K=128, num_warps=4)
FP8_STEP_CONFIGS = {"gate_up": dict(BLOCK_N=32, num_warps=4), "down": dict(BLOCK_N=128, num_warps=8)}
FP8_GATE_UP_WARPS = 8  # the elementwise form's fused gate/up


@triton.jit
def _x_row(row, k, K, stride_k, EVEN_K: tl.constexpr):
    """The activation row at k [BLOCK_K], float32."""
    x = tl.load(row + k * stride_k) if EVEN_K else tl.load(row + k * stride_k, mask=k < K, other=0.0)
    return x.to(tl.float32)


@triton.jit(do_not_specialize=["num_pairs", "limit"])
def _moe_gemv_quant_kernel(
    a_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, weights_ptr, delta_ptr, token_slot_ptr, slot_mask_ptr,
    ids_ptr, lora_b_ptr, N, K_STORED, num_pairs, limit,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    stride_be, stride_bn, stride_om, stride_on, stride_dm, stride_lbl, stride_lbe, stride_lbn,
    FORMAT: tl.constexpr, SCALE_BLOCK: tl.constexpr, SCALE_PER_STEP: tl.constexpr,
    ROW_DIV: tl.constexpr, HAS_BIAS: tl.constexpr, FUSE_ACT: tl.constexpr,
    HAS_DELTA: tl.constexpr, TOP_K: tl.constexpr, USE_SLOT_MASK: tl.constexpr,
    ACTIVATION: tl.constexpr, ALPHA: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    UPCAST: tl.constexpr, PTX: tl.constexpr, R: tl.constexpr = 1, BLOCK_R: tl.constexpr = 1,
    LORA_EXPAND: tl.constexpr = False, SPARSE_DELTA: tl.constexpr = True, PADDED_SCALES: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    # K_STORED: row length as stored (MXFP4: K / 2 bytes), specialized (divisibility) as such.
    K = 2 * K_STORED if FORMAT == "mxfp4" else K_STORED
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    row = a_ptr + (pair // ROW_DIV).to(tl.int64) * stride_am
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_cols = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn  # W.T tiles [BLOCK_K, BLOCK_N]
    s_cols = scale_ptr + expert * stride_se + offs_n[None, :] * stride_sn
    up_cols, up_s_cols = w_cols + N * stride_wn, s_cols + N * stride_sn  # FUSE_ACT: up rows, I on

    offs_k = tl.arange(0, BLOCK_K)
    if FORMAT == "mxfp4":
        acc = tl.zeros((BLOCK_K // 2, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_K // 2, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):  # bytes k0 / 2 ..: byte j holds k = 2j and 2j + 1
            x = tl.reshape(_x_row(row, k0 + offs_k, K, stride_ak, EVEN_K), (BLOCK_K // 2, 2))
            x_even, x_odd = tl.split(x)
            x_even, x_odd = x_even[:, None], x_odd[:, None]
            scale = mxfp4_scales(s_cols, k0 // 2, K_STORED, n_mask, stride_sk, BLOCK_K // 2, PADDED_SCALES)
            if PTX:
                lo, hi = mxfp4_bf16_cols(w_cols, scale, k0 // 2, K_STORED, n_mask, stride_wk, BLOCK_K // 2,
                                         EVEN_K)
            else:
                lo, hi = mxfp4_cols(w_cols, scale, k0 // 2, K_STORED, n_mask, stride_wk, BLOCK_K // 2, EVEN_K,
                                    a_ptr, UPCAST)
            acc += lo.to(tl.float32) * x_even  # two FMAs (one sum of products: FMUL, FFMA, FADD)
            acc += hi.to(tl.float32) * x_odd
            if FUSE_ACT:
                scale_up = mxfp4_scales(up_s_cols, k0 // 2, K_STORED, n_mask, stride_sk, BLOCK_K // 2,
                                        PADDED_SCALES)
                if PTX:
                    lo, hi = mxfp4_bf16_cols(up_cols, scale_up, k0 // 2, K_STORED, n_mask, stride_wk,
                                             BLOCK_K // 2, EVEN_K)
                else:
                    lo, hi = mxfp4_cols(up_cols, scale_up, k0 // 2, K_STORED, n_mask, stride_wk, BLOCK_K // 2,
                                        EVEN_K, a_ptr, UPCAST)
                acc_up += lo.to(tl.float32) * x_even
                acc_up += hi.to(tl.float32) * x_odd
        acc1, acc1_up = tl.sum(acc, 0), tl.sum(acc_up, 0)
    else:  # fp8
        acc1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        acc1_up = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if SCALE_PER_STEP:  # e4m3 values times x summed over the step, then times its scale
            for k0 in range(0, K, BLOCK_K):
                k = k0 + offs_k
                x = _x_row(row, k, K, stride_ak, EVEN_K)[:, None]
                mask = n_mask[None, :] if EVEN_K else n_mask[None, :] & (k < K)[:, None]
                s = tl.load(s_cols + (k0 // SCALE_BLOCK) * stride_sk, mask=n_mask[None, :], other=0.0)
                q = tl.load(w_cols + k[:, None] * stride_wk, mask=mask, other=0.0)
                acc1 += tl.sum(q.to(tl.float32) * x, axis=0) * tl.reshape(s, (BLOCK_N,))
                if FUSE_ACT:
                    s = tl.load(up_s_cols + (k0 // SCALE_BLOCK) * stride_sk, mask=n_mask[None, :], other=0.0)
                    q = tl.load(up_cols + k[:, None] * stride_wk, mask=mask, other=0.0)
                    acc1_up += tl.sum(q.to(tl.float32) * x, axis=0) * tl.reshape(s, (BLOCK_N,))
        else:  # a scale per value: the values dequantize gives, summed elementwise
            acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + offs_k
                x = _x_row(row, k, K, stride_ak, EVEN_K)[:, None]
                w = fp8_cols(w_cols, s_cols, k, k0, K, n_mask, stride_wk, stride_sk, SCALE_BLOCK,
                             SCALE_PER_STEP, EVEN_K, a_ptr, UPCAST)
                acc += w.to(tl.float32) * x
                if FUSE_ACT:
                    u = fp8_cols(up_cols, up_s_cols, k, k0, K, n_mask, stride_wk, stride_sk, SCALE_BLOCK,
                                 SCALE_PER_STEP, EVEN_K, a_ptr, UPCAST)
                    acc_up += u.to(tl.float32) * x
            acc1, acc1_up = tl.sum(acc, 0), tl.sum(acc_up, 0)
        if UPCAST:  # the interpreter's float32 -> bf16 store truncates: round as a GPU's store does
            acc1, acc1_up = operand(acc1, out_ptr, UPCAST), operand(acc1_up, out_ptr, UPCAST)

    # The pair as a one-row tile, for the grouped GEMM's epilogue.
    pairs = pair + tl.arange(0, 1)
    add, add_up, weight = pair_operands(
        expert, pairs, pairs < num_pairs, offs_n, n_mask, N, bias_ptr, weights_ptr, delta_ptr, token_slot_ptr,
        slot_mask_ptr, stride_be, stride_bn, stride_dm, HAS_BIAS, FUSE_ACT, HAS_DELTA, TOP_K, USE_SLOT_MASK,
        MUL_ROUTED_WEIGHT, EVEN_N, lora_b_ptr, stride_lbl, stride_lbe, stride_lbn, R, BLOCK_R, LORA_EXPAND,
        SPARSE_DELTA)
    store_pairs(acc1[None, :], acc1_up[None, :], add, add_up, weight, pairs, pairs < num_pairs, offs_n,
                n_mask, limit, out_ptr, stride_om, stride_on, FUSE_ACT, ACTIVATION, ALPHA, MUL_ROUTED_WEIGHT,
                EVEN_N)


def moe_gemv_quant(
    a: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None, out: torch.Tensor,
    topk_ids: torch.Tensor, row_div: int, activation: str | None = None, limit: float = math.inf,
    routed_weights: torch.Tensor | None = None, delta: torch.Tensor | None = None,
    lora: MoELoRA | None = None, top_k: int = 1, lora_b: torch.Tensor | None = None,
) -> None:
    """out[p] = A[p // row_div] @ dequantize(w)[topk_ids.flat[p]].T (+ bias), for every
    pair p of topk_ids [T, top_k]; the other arguments as moe_gemm's (moe_gemm.py).
    lora_b [L, E, n_w, R] (with delta): delta holds each pair's shrunk row, float32 [P, R]
    (moe_lora_gemv without its B), and each program expands it at its own columns."""
    e, n_w, k = w.shape
    n = n_w // 2 if activation else n_w
    num_pairs = topk_ids.numel()
    assert a.shape[1] == k and out.shape == (num_pairs, n), (a.shape, w.shape, out.shape)
    assert a.dtype == w.dtype and topk_ids.is_contiguous(), (a.dtype, w.dtype)
    if routed_weights is not None:
        assert routed_weights.dtype == torch.float32 and routed_weights.is_contiguous()
    check_delta(delta, lora, lora_b, num_pairs, e, n_w)
    if num_pairs == 0:
        return
    # A K step dividing K where one does: unmasked rows, 16-byte loads (gpt-oss: 2880 = 45 x 64).
    block_k = next((b for b in (GEMV_CONFIG["BLOCK_K"], 64, 32) if k % b == 0), GEMV_CONFIG["BLOCK_K"])
    cfg = dict(GEMV_CONFIG, BLOCK_K=block_k)
    args = format_args(w, block_k)
    if isinstance(w, Fp8Weight) and args["SCALE_PER_STEP"]:
        cfg.update(FP8_STEP_CONFIGS["gate_up" if activation else "down"])
    elif activation is not None and isinstance(w, Fp8Weight):
        cfg["num_warps"] = FP8_GATE_UP_WARPS
    grid = (num_pairs, triton.cdiv(n, cfg["BLOCK_N"]))
    _moe_gemv_quant_kernel[grid](
        a, w.data, w.scale, bias if bias is not None else a, out,
        routed_weights if routed_weights is not None else a, delta if delta is not None else a,
        lora.token_slot if lora is not None else a,
        lora.slot_mask if lora is not None and lora.slot_mask is not None else a,
        topk_ids, lora_b if lora_b is not None else a, n, w.data.shape[-1], num_pairs, limit,
        *a.stride(), *w.data.stride(), *w.scale.stride(), *(bias.stride() if bias is not None else (0, 0)),
        *out.stride(), delta.stride(0) if delta is not None else 0,
        *(lora_b.stride()[:3] if lora_b is not None else (0, 0, 0)),
        **args, ROW_DIV=row_div, HAS_BIAS=bias is not None,
        FUSE_ACT=activation is not None, HAS_DELTA=delta is not None, TOP_K=top_k,
        USE_SLOT_MASK=lora is not None and lora.slot_mask is not None, SPARSE_DELTA=lora is not None,
        ACTIVATION=activation or "none", ALPHA=SWIGLU_OAI_ALPHA,
        MUL_ROUTED_WEIGHT=routed_weights is not None,
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], EVEN_K=k % cfg["BLOCK_K"] == 0,
        EVEN_N=n % cfg["BLOCK_N"] == 0, UPCAST=INTERPRETED, PTX=mxfp4_path(w) == "ptx",
        R=lora_b.shape[3] if lora_b is not None else 1,
        BLOCK_R=triton.next_power_of_2(lora_b.shape[3]) if lora_b is not None else 1,
        LORA_EXPAND=lora_b is not None, num_warps=cfg["num_warps"],
        **pdl(),
    )
