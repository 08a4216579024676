"""Grouped GEMM of quantized MoE experts (MXFP4, FP8 block-scaled) over aligned pair
blocks: out[pair, :] = A[row(pair)] @ dequantize(W)[expert(block)].T (+ bias[expert])
(+ delta[pair]), with moe_gemm.py's tiling, options and epilogue (moe_epilogue.py:
activation, routing weight, LoRA delta); only the weight tiles differ.

Oracle: ops.reference.moe.fused_experts with the same QuantizedWeight (it dequantizes
first). Each K step reads the weight's own bytes and scales and dequantizes them in
registers (quant_tiles.py) to exactly the values dequantize gives, rounded to the
activations' dtype; tl.dot on those (bf16 MMA on Hopper, which has no FP4 MMA; FP8
weights meet unquantized activations), float32 accumulation. W8A8 FP8 experts
(act_block) are the exception: A comes as e4m3 rows with their scales, and each K step
is an e4m3 MMA (quant_tiles.fp8_w8a8_step; the oracle quantizes A the same way).

- MXFP4 (Mxfp4Weight: data [E, N, K / 2], e2m1 codes 8 to a 4-byte word in the
  decode's bit order, ops/formats/e2m1_words.py; scale [E, N, K / 32] e8m0): a step of
  BLOCK_K reads BLOCK_K / 2 bytes per row and their BLOCK_K / 32 scales, and turns them
  into bf16 operands one of two ways (MXFP4_PATH, mxfp4_path() picks), which the decode
  step is bound by (instruction issue: benchmarks/RESULTS.md, "Quantized bases"):
  - "ptx", bf16 on a GPU with every scale <= 128 (trained weights: blocks up to 12):
    quant_tiles.mxfp4_bf16_cols masks, rotates or spreads each word's codes into bf16
    bits and scales two values per multiply (1.5 instructions a value for the decode;
    ~3 SASS instructions a weight value in the loop, sm_90, BLOCK_N 64 x BLOCK_K 128);
  - "hand", other cases (float16 / float32 activations, scales above 128, the
    interpreter's float32 reads): quant_tiles.mxfp4_cols decodes in float32 and rounds
    to their dtype.
  Both give W at the even k and at the odd k, multiplied by A's even and odd columns (A's
  tile loaded whole, split in registers) in two dots of BLOCK_K / 2 (so BLOCK_K >= 32:
  tl.dot needs K >= 16). Blocks stay decode-sized where no tuned file says otherwise
  (moe_gemm.MXFP4_DEFAULT_CONFIGS: taller ones only repeat the decode on mma.sync);
  prompt-sized steps read the experts dequantized (moe_configs.dequantized).
- FP8 (Fp8Weight: data [E, N, K] e4m3; scale [E, N, ceil(K / block_k)] float32): one
  scale per column in a step when the step lies in one scale block (block_k = 128 and
  BLOCK_K <= 128: Qwen3-30B-A3B-FP8), else one per value.

Tuned configs come from their own files (moe_configs.py: `moe_gemm_<format>_...`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from loraplex.ops.formats import QuantizedWeight
from loraplex.ops.metadata import MoELoRA
from loraplex.ops.reference.moe import SWIGLU_OAI_ALPHA
from loraplex.ops.reference.quant import w8a8
from loraplex.ops.triton.gemm_tiles import row_tile
from loraplex.ops.triton.launch import pdl, wait_for_inputs
from loraplex.ops.triton.moe_align import Alignment
from loraplex.ops.triton.moe_epilogue import check_delta, operands_first, pair_operands, store_pairs
from loraplex.ops.triton.precision import dot_settings
from loraplex.ops.triton.quant_tiles import (
    even_odd,
    format_args,
    fp8_cols,
    fp8_w8a8_step,
    mxfp4_bf16_cols,
    mxfp4_cols,
    mxfp4_path,
    mxfp4_scale_pair,
    mxfp4_scales,
)

MIN_BLOCK_K = 32  # MXFP4: two dots of BLOCK_K / 2


@triton.jit(do_not_specialize=["num_pairs", "num_blocks", "limit"])
def _moe_gemm_quant_kernel(
    a_ptr, a_scale_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, weights_ptr, delta_ptr, token_slot_ptr,
    slot_mask_ptr,
    sorted_ids_ptr, block_experts_ptr, num_valid_ptr,
    N, K_STORED, num_pairs, num_blocks, limit,
    stride_am, stride_ak, stride_asm, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    stride_be, stride_bn, stride_om, stride_on, stride_dm,
    FORMAT: tl.constexpr, SCALE_BLOCK: tl.constexpr, SCALE_PER_STEP: tl.constexpr,
    W8A8: tl.constexpr, ACT_BLOCK: tl.constexpr,
    ROW_DIV: tl.constexpr, HAS_BIAS: tl.constexpr, FUSE_ACT: tl.constexpr,
    HAS_DELTA: tl.constexpr, TOP_K: tl.constexpr, USE_SLOT_MASK: tl.constexpr,
    SPARSE_DELTA: tl.constexpr, OPERANDS_FIRST: tl.constexpr,
    ACTIVATION: tl.constexpr, ALPHA: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    MXFP4_PATH: tl.constexpr, PADDED_SCALES: tl.constexpr = False, PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    # K_STORED: row length as stored (MXFP4: K / 2 bytes), specialized (divisibility) as such.
    K = 2 * K_STORED if FORMAT == "mxfp4" else K_STORED
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
    # EVEN_N: a constant mask, which the compiler drops (gpt-oss's gate/up: no select per
    # scale and copy in the K loop, 389 -> 365 instructions a step)
    n_mask = offs_n < N if not EVEN_N else tl.full((BLOCK_N,), 1, tl.int1)
    a_rows = a_ptr + rows[:, None] * stride_am
    w_cols = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn  # W.T tiles [BLOCK_K, BLOCK_N]
    s_cols = scale_ptr + expert * stride_se + offs_n[None, :] * stride_sn
    up_cols, up_s_cols = w_cols + N * stride_wn, s_cols + N * stride_sn  # FUSE_ACT: up rows, I on

    if OPERANDS_FIRST:  # no dependent loads among them: in flight during the main loop
        add, add_up, weight = pair_operands(expert, pairs, m_mask, offs_n, n_mask, N, bias_ptr, weights_ptr,
                                            delta_ptr, token_slot_ptr, slot_mask_ptr, stride_be, stride_bn,
                                            stride_dm, HAS_BIAS, FUSE_ACT, HAS_DELTA, TOP_K, USE_SLOT_MASK,
                                            MUL_ROUTED_WEIGHT, EVEN_N, SPARSE_DELTA=SPARSE_DELTA)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    if FORMAT == "mxfp4":
        for k0 in range(0, K, BLOCK_K):  # bytes k0 / 2 ..: byte j's place holds k = 2j and 2j + 1
            j0 = k0 // 2
            a_even, a_odd = even_odd(row_tile(a_rows, k0 + offs_k, K, m_mask, stride_ak, EVEN_K, UPCAST))
            if FUSE_ACT:
                scale, scale_up = mxfp4_scale_pair(s_cols, N * stride_sn, j0, K_STORED, n_mask, stride_sk,
                                                   BLOCK_K // 2, PADDED_SCALES)
            else:
                scale = mxfp4_scales(s_cols, j0, K_STORED, n_mask, stride_sk, BLOCK_K // 2, PADDED_SCALES)
            if MXFP4_PATH == "ptx":
                lo, hi = mxfp4_bf16_cols(w_cols, scale, j0, K_STORED, n_mask, stride_wk, BLOCK_K // 2, EVEN_K)
            else:
                lo, hi = mxfp4_cols(w_cols, scale, j0, K_STORED, n_mask, stride_wk, BLOCK_K // 2, EVEN_K,
                                    a_ptr, UPCAST)
            acc = tl.dot(a_even, lo, acc, input_precision=DOT_PRECISION)
            acc = tl.dot(a_odd, hi, acc, input_precision=DOT_PRECISION)
            if FUSE_ACT:
                if MXFP4_PATH == "ptx":
                    lo, hi = mxfp4_bf16_cols(up_cols, scale_up, j0, K_STORED, n_mask, stride_wk, BLOCK_K // 2,
                                             EVEN_K)
                else:
                    lo, hi = mxfp4_cols(up_cols, scale_up, j0, K_STORED, n_mask, stride_wk, BLOCK_K // 2,
                                        EVEN_K, a_ptr, UPCAST)
                acc_up = tl.dot(a_even, lo, acc_up, input_precision=DOT_PRECISION)
                acc_up = tl.dot(a_odd, hi, acc_up, input_precision=DOT_PRECISION)
    elif W8A8:  # fp8, A quantized too (e4m3 rows, a scale per row and ACT_BLOCK columns)
        as_rows = a_scale_ptr + rows * stride_asm
        SWAP: tl.constexpr = BLOCK_M < 64  # W's rows on the MMA's M side (fp8_w8a8_step)
        if SWAP:  # the sums transposed, [BLOCK_N, BLOCK_M], until the epilogue
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            a = row_tile(a_rows, k, K, m_mask, stride_ak, EVEN_K, UPCAST)
            a_scale = tl.load(as_rows + k0 // ACT_BLOCK, mask=m_mask, other=0.0)
            acc += fp8_w8a8_step(a, a_scale, w_cols, s_cols, k, k0, K, n_mask, stride_wk, stride_sk,
                                 SCALE_BLOCK, EVEN_K, UPCAST, SWAP)
            if FUSE_ACT:
                acc_up += fp8_w8a8_step(a, a_scale, up_cols, up_s_cols, k, k0, K, n_mask, stride_wk,
                                        stride_sk, SCALE_BLOCK, EVEN_K, UPCAST, SWAP)
        if SWAP:
            acc = tl.trans(acc)
            acc_up = tl.trans(acc_up)
    else:  # fp8
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            a = row_tile(a_rows, k, K, m_mask, stride_ak, EVEN_K, UPCAST)
            w = fp8_cols(w_cols, s_cols, k, k0, K, n_mask, stride_wk, stride_sk, SCALE_BLOCK, SCALE_PER_STEP,
                         EVEN_K, a_ptr, UPCAST)
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
            if FUSE_ACT:
                u = fp8_cols(up_cols, up_s_cols, k, k0, K, n_mask, stride_wk, stride_sk, SCALE_BLOCK,
                             SCALE_PER_STEP, EVEN_K, a_ptr, UPCAST)
                acc_up = tl.dot(a, u, acc_up, input_precision=DOT_PRECISION)

    if not OPERANDS_FIRST:
        add, add_up, weight = pair_operands(expert, pairs, m_mask, offs_n, n_mask, N, bias_ptr, weights_ptr,
                                            delta_ptr, token_slot_ptr, slot_mask_ptr, stride_be, stride_bn,
                                            stride_dm, HAS_BIAS, FUSE_ACT, HAS_DELTA, TOP_K, USE_SLOT_MASK,
                                            MUL_ROUTED_WEIGHT, EVEN_N, SPARSE_DELTA=SPARSE_DELTA)
    store_pairs(acc, acc_up, add, add_up, weight, pairs, m_mask, offs_n, n_mask, limit, out_ptr, stride_om,
                stride_on, FUSE_ACT, ACTIVATION, ALPHA, MUL_ROUTED_WEIGHT, EVEN_N)


def moe_gemm_quant(
    a: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None, out: torch.Tensor,
    align: Alignment, cfg: dict, row_div: int, activation: str | None = None,
    limit: float = math.inf, routed_weights: torch.Tensor | None = None,
    delta: torch.Tensor | None = None, lora: MoELoRA | None = None, top_k: int = 1,
    a_scale: torch.Tensor | None = None,
) -> None:
    """moe_gemm (moe_gemm.py, same arguments) with w a quantized weight of logical shape
    [E, N, K], read as dequantize(w); or, W8A8 (an Fp8Weight with act_block, in a step
    where it quantizes its activations), `a` the e4m3 rows and `a_scale` their scales
    (fp8_activations.quantize_activations)."""
    assert cfg["BLOCK_M"] == align.block_m, (cfg, align.block_m)
    e, n_w, k = w.shape
    n = n_w // 2 if activation else n_w
    assert a.shape[1] == k and out.shape == (align.num_pairs, n), (a.shape, w.shape, out.shape)
    a8 = a_scale is not None
    assert a.dtype == (torch.float8_e4m3fn if a8 else w.dtype) and (w8a8(w) or not a8), (a.dtype, w.dtype)
    if routed_weights is not None:
        assert routed_weights.dtype == torch.float32 and routed_weights.is_contiguous()
    check_delta(delta, lora, None, align.num_pairs, e, n_w)
    block_k = max(cfg["BLOCK_K"], MIN_BLOCK_K)
    if a8:  # a K step inside one block of a's and of w's scales
        assert w.act_block == w.block_k, (w.act_block, w.block_k)
        block_k = min(block_k, w.act_block)
    grid = (align.num_blocks * triton.cdiv(n, cfg["BLOCK_N"]),)
    _moe_gemm_quant_kernel[grid](
        a, a_scale if a8 else w.scale, w.data, w.scale, bias if bias is not None else w.scale, out,
        routed_weights if routed_weights is not None else w.scale, delta if delta is not None else w.scale,
        lora.token_slot if lora is not None else w.scale,
        lora.slot_mask if lora is not None and lora.slot_mask is not None else w.scale,
        align.sorted_ids, align.block_groups, align.num_valid,
        n, w.data.shape[-1], align.num_pairs, align.num_blocks, limit,
        *a.stride(), a_scale.stride(0) if a8 else 0, *w.data.stride(), *w.scale.stride(),
        *(bias.stride() if bias is not None else (0, 0)),
        *out.stride(), delta.stride(0) if delta is not None else 0,
        **format_args(w, block_k), W8A8=a8, ACT_BLOCK=w.act_block if a8 else 1, ROW_DIV=row_div,
        HAS_BIAS=bias is not None,
        FUSE_ACT=activation is not None, HAS_DELTA=delta is not None, TOP_K=top_k,
        USE_SLOT_MASK=lora is not None and lora.slot_mask is not None,
        SPARSE_DELTA=lora is not None,
        OPERANDS_FIRST=operands_first(delta is not None and lora is not None, cfg["BLOCK_M"]),
        ACTIVATION=activation or "none", ALPHA=SWIGLU_OAI_ALPHA,
        MUL_ROUTED_WEIGHT=routed_weights is not None,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k, GROUP_M=cfg["GROUP_M"],
        EVEN_K=k % block_k == 0, EVEN_N=n % cfg["BLOCK_N"] == 0, **dot_settings(w.dtype),
        MXFP4_PATH=mxfp4_path(w), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **pdl(),
    )
