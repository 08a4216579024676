"""W4A16 GEMM of an int4 weight (ops/formats Int4Weight: AWQ, GPTQ).

Semantics: out[t, n] = sum_k x[t, k] W[n, k] + bias[n], W[n, k] = (q[n, k] - zero[n, k //
G]) * scale[n, k // G] computed in float32 and rounded once to w.dtype (then x's dtype),
as ops.reference.quant.linear reads dequantize(w); float32 accumulation.

W is never written out: each program reads its tile of packed bytes ([BLOCK_N, BLOCK_K /
2] uint8, k = 2j in byte j's low nibble), splits the nibbles in registers (interleaved
back into K order), turns them into floats without an int-to-float conversion (the code
as a float32 mantissa under the exponent of 2^23, minus 2^23), applies the group's zero
and scale in float32 and feeds tl.dot in x's dtype (bf16 / fp16 tensor cores; float32
IEEE). That decode costs ~10 instructions a weight on sm_90, which bounds a decode step
(Llama-3.1-8B AWQ at 32 in flight: 1.12x the bf16 step, H100). With bf16 on an sm_90
GPU, integer zero points and a step inside one group (`bf16x2_decode`), the bytes are
decoded in bf16x2 arithmetic instead (quant_tiles.int4_bf16_pairs: ~2 instructions a
weight, the same values), into W at the even and at the odd k, which meet x's even and
odd columns in two dots. The group's scale and zero come once per K step: one
[BLOCK_N] vector when a step lies inside one group (G a multiple of BLOCK_K), a
[BLOCK_N, BLOCK_K / G] tile spread over the step when several groups fit in it, else
gathered per k (odd group sizes of small random models).

Two regimes, one kernel (int4_configs.py: defaults by token count, or tuned files):
- decode (T <= 64): small BLOCK_M (16, 32, 64 by T: mma tiles, a lone token padded to 16
  rows) and split-K. The step is bound by reading W (4.25 bits a weight: 4, and a bf16
  scale and zero per 128), so the grid is widened along K until every SM streams several
  tiles; each split writes float32 partial sums and a second small kernel adds them (in
  a fixed order: no atomics), the bias, and rounds once (split_k_sum.py; an adapted
  projection's LoRA expand joins it there, ops.lora_linear). The default split is capped
  so the partials' traffic (2 x SPLIT_K x T x N x 4 bytes) stays under a quarter of W's
  bytes; tuned configs pick theirs by time.
- prefill: 64 / 128-row tensor-core tiles in grouped order (GROUP_M row blocks sweep the
  column blocks together, so a W tile is reused from L2), no split.
The grid and every constexpr follow the shapes (and the SM count, or the tuned file of
this GPU) alone: CUDA graphs replay the launches.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from loraplex.ops.formats import Int4Weight
from loraplex.ops.triton.int4_configs import int4_config
from loraplex.ops.triton.launch import pdl, wait_for_inputs
from loraplex.ops.triton.precision import INTERPRETED, dot_settings
from loraplex.ops.triton.quant_tiles import even_odd, int4_bf16_pairs
from loraplex.ops.triton.split_k_sum import FusedExpand, split_k_sum

# Prefill: from this many tokens, W dequantized into a scratch tensor (4 bytes a weight
# written and read) and cuBLAS's bf16 GEMM beat the W4A16 kernel's tensor-core tiles.
# Llama-3.1-8B's qkv + gate_up + down, H100 (us): 128 tokens ~366 against 473, 2048
# tokens 1,255 against 2,349; at 32 tokens the kernel's 100 against ~350.
DEQUANTIZE_MIN_TOKENS = 128
DEQUANTIZE_BLOCK_N = 32
# Pipelined tiles must fit an H100's 227 KiB of shared memory per block, with room left
# for the epilogue's layout conversions.
SHARED_MEMORY_BUDGET = 192 * 1024


@triton.jit
def _group_values(rows, k0, k, K, n_mask, stride_g, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] (or broadcastable [BLOCK_N, 1]) float32 scales or zeros of
    the step at k0 (`rows`: [BLOCK_N] pointers to each row's groups)."""
    if GROUP % BLOCK_K == 0:  # the step lies inside one group
        v = tl.load(rows + (k0 // GROUP) * stride_g, mask=n_mask, other=0.0).to(tl.float32)
        return v[:, None]
    elif BLOCK_K % GROUP == 0:  # BLOCK_K / GROUP whole groups
        g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        mask = n_mask[:, None] if EVEN_K else n_mask[:, None] & (g[None, :] < K // GROUP)
        v = tl.load(rows[:, None] + g[None, :] * stride_g, mask=mask, other=0.0).to(tl.float32)
        v = tl.broadcast_to(v[:, :, None], (BLOCK_N, BLOCK_K // GROUP, GROUP))
        return tl.reshape(v, (BLOCK_N, BLOCK_K))
    else:  # gathered per k
        mask = n_mask[:, None] if EVEN_K else n_mask[:, None] & (k[None, :] < K)
        return tl.load(rows[:, None] + (k // GROUP)[None, :] * stride_g, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _rounded(w, like_ptr, UPCAST: tl.constexpr):
    """float32 w rounded to nearest (even) in like_ptr's element type. The interpreter
    truncates float32 -> bf16, so there bf16's rounding is done on the bits first."""
    if UPCAST and like_ptr.dtype.element_ty == tl.bfloat16:
        bits = w.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        w = bits.to(tl.float32, bitcast=True)
    return w.to(like_ptr.dtype.element_ty)


@triton.jit
def _decoded(packed, s_rows, z_rows, scale_ptr, k0, k, K, n_mask, stride_sg, GROUP: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr):
    """The step's bytes [BLOCK_N, BLOCK_K / 2] -> W [BLOCK_N, BLOCK_K] in the scales'
    dtype, (q - zero) x scale computed in float32 and rounded once, as dequantize does.
    Each nibble under the exponent of 2^23 is 2^23 + code as float32 bits; minus 2^23, the
    code as a float, exactly (no int-to-float conversion); interleaved back into K order."""
    packed = packed.to(tl.int32)
    low = ((packed & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
    high = ((packed >> 4) | 0x4B000000).to(tl.float32, bitcast=True)
    q = tl.interleave(low, high) - 8388608.0
    scale = _group_values(s_rows, k0, k, K, n_mask, stride_sg, GROUP, BLOCK_N, BLOCK_K, EVEN_K)
    zero = _group_values(z_rows, k0, k, K, n_mask, stride_sg, GROUP, BLOCK_N, BLOCK_K, EVEN_K)
    return _rounded((q - zero) * scale, scale_ptr, UPCAST)


@triton.jit(do_not_specialize=["M"])
def _int4_gemm_kernel(
    x_ptr, q_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_qn, stride_sn, stride_sg, stride_os, stride_om,
    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BF16X2: tl.constexpr = False, PAIRED: tl.constexpr = False, PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    # Grouped ordering: GROUP_M consecutive row blocks sweep the column blocks together.
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    m_blocks = tl.cdiv(M, BLOCK_M)
    n_blocks = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * n_blocks
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_b = tl.arange(0, BLOCK_K // 2)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    q_rows = q_ptr + offs_n.to(tl.int64)[:, None] * stride_qn
    s_rows = scale_ptr + offs_n.to(tl.int64) * stride_sn
    z_rows = zero_ptr + offs_n.to(tl.int64) * stride_sn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_chunk = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    for k0 in range(pid_k * k_chunk, tl.minimum((pid_k + 1) * k_chunk, K), BLOCK_K):
        k = k0 + offs_k
        kb = k0 // 2 + offs_b
        if EVEN_K:
            x = tl.load(x_rows + k[None, :], mask=m_mask[:, None], other=0.0)
            if EVEN_N:
                packed = tl.load(q_rows + kb[None, :])
            else:
                packed = tl.load(q_rows + kb[None, :], mask=n_mask[:, None], other=0)
        else:
            x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & (k[None, :] < K), other=0.0)
            packed = tl.load(q_rows + kb[None, :], mask=n_mask[:, None] & (kb[None, :] < K // 2), other=0)
        if BF16X2:  # decoded in bf16x2 arithmetic, even and odd k apart (bf16x2_decode)
            if PAIRED:  # (scale, zero) of a row's group as one 32-bit word (Int4Weight.paired_scales)
                words = (s_rows + (k0 // GROUP) * 2).to(tl.pointer_type(tl.uint32))
                pair = tl.load(words, mask=n_mask, other=0)
                scale = (pair & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
                zero = (pair >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True).to(tl.float32)
            else:
                g = (k0 // GROUP) * stride_sg
                zero = tl.load(z_rows + g, mask=n_mask, other=0.0).to(tl.float32)
                scale = tl.load(s_rows + g, mask=n_mask, other=0.0)
            w_even, w_odd = int4_bf16_pairs(packed, zero[:, None], scale[:, None])
            x_even, x_odd = even_odd(x)
            acc += tl.dot(x_even, tl.trans(w_even), input_precision=DOT_PRECISION)
            acc += tl.dot(x_odd, tl.trans(w_odd), input_precision=DOT_PRECISION)
        else:
            # W in its dtype (the scales'), as dequantize rounds it, then in x's (the same
            # in a model: no-op).
            w = _decoded(packed, s_rows, z_rows, scale_ptr, k0, k, K, n_mask, stride_sg, GROUP, BLOCK_N,
                         BLOCK_K, EVEN_K, UPCAST).to(x_ptr.dtype.element_ty)
            if UPCAST:
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)

    out = out_ptr + pid_k * stride_os + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        acc = acc.to(out_ptr.dtype.element_ty)
    if EVEN_N:
        tl.store(out, acc, mask=m_mask[:, None])
    else:
        tl.store(out, acc, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _int4_dequantize_kernel(q_ptr, scale_ptr, zero_ptr, out_ptr, N, K, stride_qn, stride_sn, stride_sg,
                            stride_on, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            UPCAST: tl.constexpr, PDL: tl.constexpr = False):
    """out = dequantize(W) in W's dtype: the GEMM's float32 decode, written out."""
    wait_for_inputs(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    k = k0 + tl.arange(0, BLOCK_K)
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    n_mask = offs_n < N
    packed = tl.load(q_ptr + offs_n.to(tl.int64)[:, None] * stride_qn + kb[None, :],
                     mask=n_mask[:, None] & (kb[None, :] < K // 2), other=0)
    s_rows = scale_ptr + offs_n.to(tl.int64) * stride_sn
    z_rows = zero_ptr + offs_n.to(tl.int64) * stride_sn
    w = _decoded(packed, s_rows, z_rows, scale_ptr, k0, k, K, n_mask, stride_sg, GROUP, BLOCK_N, BLOCK_K,
                 False, UPCAST)
    tl.store(out_ptr + offs_n.to(tl.int64)[:, None] * stride_on + k[None, :], w,
             mask=n_mask[:, None] & (k[None, :] < K))


def fit_stages(cfg: dict, group: int, x_bytes: int, w_bytes: int) -> dict:
    """cfg with num_stages lowered until its pipelined tiles fit SHARED_MEMORY_BUDGET.
    The defaults are sized for bf16 activations and whole groups per step: float32
    activations, or scales and zeros gathered per k (a group size that is not a multiple
    of 16), take 2-4x the bytes per stage."""
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    if group % bk == 0:
        groups_per_step = 1
    elif bk % group == 0:
        groups_per_step = bk // group
    else:
        groups_per_step = bk  # one scale and zero per k
    per_stage = bm * bk * x_bytes + bn * bk // 2 + 2 * bn * groups_per_step * w_bytes
    stages = cfg.get("num_stages", 3)
    while stages > 1 and stages * per_stage > SHARED_MEMORY_BUDGET:
        stages -= 1
    return {**cfg, "num_stages": stages}


def bf16x2_decode(x: torch.Tensor, w: Int4Weight, block_k: int) -> bool:
    """Whether the kernel decodes W in bf16x2 arithmetic: bf16 activations and scales on
    an sm_90 GPU (its sub/mul.bf16x2), every step inside one group, and zero points that
    make q - zero exact in bf16 (known before any CUDA graph capture: a warm-up step
    asks first)."""
    return (x.dtype == torch.bfloat16 and w.scale.dtype == torch.bfloat16 and x.is_cuda
            and _capability(x.device) >= (9, 0) and w.group % block_k == 0 and bool(w.integer_zeros()))


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _paired_words(w: Int4Weight) -> bool:
    """Whether the bf16x2 decode reads each group's (scale, zero) as one aligned 32-bit
    word: 2-byte loads stay out of Triton's cp.async pipeline, so each K step waited on
    global memory for them (the sm_90 codegen: LDG.E.U16 in the loop, none this way)."""
    return w.paired_scales() and w.scale.element_size() == 2 and w.scale.data_ptr() % 4 == 0


def int4_dequantize(w: Int4Weight) -> torch.Tensor:
    """dequantize(w) [N, K] in w's dtype, by one kernel."""
    n, k = w.shape
    out = torch.empty(n, k, dtype=w.dtype, device=w.data.device)
    block_k = min(128, triton.next_power_of_2(k))
    grid = (triton.cdiv(n, DEQUANTIZE_BLOCK_N), triton.cdiv(k, block_k))
    _int4_dequantize_kernel[grid](
        w.data, w.scale, w.zero, out, n, k,
        w.data.stride(0), w.scale.stride(0), w.scale.stride(1), out.stride(0),
        GROUP=w.group, BLOCK_N=DEQUANTIZE_BLOCK_N, BLOCK_K=block_k, UPCAST=INTERPRETED,
        **pdl(),
    )
    return out


def int4_fuses_expand(x: torch.Tensor, w: Int4Weight) -> bool:
    """Whether int4_linear of x can take a FusedExpand: its config splits K."""
    m, (n, k) = x.numel() // x.shape[-1], w.shape
    return (x.is_cuda and 0 < m < DEQUANTIZE_MIN_TOKENS
            and int4_config(m, n, k, w.group, x.device, x.dtype)["SPLIT_K"] > 1)


def int4_linear(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None, config: dict | None = None,
                lora: FusedExpand | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize(w).T + bias -> [..., N] in x's dtype. `config` (tests)
    replaces int4_config's. Steps of DEQUANTIZE_MIN_TOKENS tokens or more on a GPU
    dequantize W into a scratch tensor and run the dense GEMM (cuBLAS). `lora`: its
    expand added in the split-K sum (the config must split K: int4_fuses_expand)."""
    n, k = w.shape
    assert w.data.dim() == 2 and x.shape[-1] == k, (x.shape, w.shape)
    assert w.data.stride(1) == 1 and w.scale.stride() == w.zero.stride(), (w.scale.stride(), w.zero.stride())
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if config is None and m >= DEQUANTIZE_MIN_TOKENS and x.is_cuda and lora is None:
        out = torch.nn.functional.linear(x2, int4_dequantize(w).to(x.dtype), bias)
        return out.view(*lead, n)
    bias = bias.contiguous() if bias is not None else None
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*lead, n)
    cfg = dict(config) if config is not None else int4_config(m, n, k, w.group, x.device, x.dtype)
    cfg = fit_stages(cfg, w.group, x.element_size(), w.scale.element_size())
    bf16x2 = cfg.pop("BF16X2", None)
    if bf16x2 is None:
        bf16x2 = bf16x2_decode(x, w, cfg["BLOCK_K"])
    split_k = cfg.pop("SPLIT_K", 1)
    assert lora is None or split_k > 1, "a fused LoRA expand needs the split-K sum"
    num_warps, num_stages = cfg.pop("num_warps", 4), cfg.pop("num_stages", 3)
    dest = out if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), split_k)
    _int4_gemm_kernel[grid](
        x2, w.data, w.scale, w.zero, bias if bias is not None else w.scale, dest,
        m, n, k,
        x2.stride(0), w.data.stride(0), w.scale.stride(0), w.scale.stride(1),
        dest.stride(0) if split_k > 1 else 0, dest.stride(-2),
        GROUP=w.group, HAS_BIAS=bias is not None, SPLIT_K=split_k,
        EVEN_N=n % cfg["BLOCK_N"] == 0, EVEN_K=k % cfg["BLOCK_K"] == 0,
        **cfg, **dot_settings(x.dtype), BF16X2=bf16x2, PAIRED=_paired_words(w),
        num_warps=num_warps, num_stages=num_stages,
        **pdl(),
    )
    if split_k > 1:
        split_k_sum(dest, bias, out, lora)
    return out.view(*lead, n)
