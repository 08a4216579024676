"""Dense GEMM of an FP8 weight: weight-only (W dequantized in registers) or W8A8.

Weight-only (Fp8Weight.act_block 0):
y[t, n] = sum_k x[t, k] * Wd[n, k] + bias[n], Wd = dequantize(W) (ops.linear's semantics).
W8A8 (act_block set: `--fp8-activations dynamic` on block-scaled weights, or `prefill`
in steps of act_min_tokens or more; ops.reference.quant.w8a8 decides): x is quantized to
e4m3 rows first (fp8_activations.py), and each K step (inside one scale block of x and
of W) is an e4m3 x e4m3 MMA scaled by the two blocks' scales, float32 sums, rounded
once (ops.reference.quant.linear). Tiles at every token count; under 64 rows the
operands swap (W's rows on the MMA's M side) so that Hopper runs wgmma on e4m3.
The rest of this note is the weight-only kernel.

W is an Fp8Weight (ops/formats): e4m3 data [N, K] and float32 scale [N, ceil(K /
block_k)] (block_k 128 for block-scaled checkpoints and load-time quantization, K per
channel). Each W element is read once per program as its byte, widened to float32,
multiplied by its scale and rounded as ops.dequantize rounds it (to the weight's dtype,
then to x's): the values the product sees are dequantize(W)'s, bit for bit. Activations
are not quantized. fp32 accumulation; the output (x's dtype) is rounded once, after the
bias.

Two forms of the one kernel, chosen by the config's BLOCK_M (fp8_configs.py):
- GEMV (BLOCK_M < 16, decode): a few tokens, so the step is bound by reading W's bytes
  (one per weight). Each program streams BLOCK_N rows of W along K and forms every
  token's products with them by multiplies and a reduction in registers (a tensor-core
  tile would be mostly padding); small BLOCK_N gives the launch enough programs.
- tiles (BLOCK_M >= 16, large decode batches; prefill on CPUs): tensor-core tiles, the
  dequantized [BLOCK_K, BLOCK_N] W tile fed to tl.dot as x's dtype (bf16 MMA), grouped
  program order so GROUP_M row blocks share W tiles in L2.
From DEQUANTIZE_MIN_TOKENS tokens on a GPU, W is dequantized whole and cuBLAS multiplies.

Split K (the config's SPLIT_K, decode sizes; either form, and W8A8): each split's
programs write float32 sums of their K columns and split_k_sum.py adds them, the bias,
and an adapted projection's LoRA expand (ops.lora_linear: one launch fewer), rounding
once.

Scales (scale_mode): one per row loaded once (per channel), one per row and tile
(BLOCK_K divides block_k), whole blocks broadcast over the tile (block_k a power of 2
dividing BLOCK_K: the GEMV form's long K steps), else one gathered per element.

The grid follows T, N and the config alone (no host sync, nothing read from the device),
so CUDA graphs replay it; T is not specialized (one compiled variant for any count).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from loraplex.ops.formats import Fp8Rows, Fp8Weight
from loraplex.ops.reference.quant import linear as reference_linear
from loraplex.ops.reference.quant import w8a8
from loraplex.ops.triton.dequantize import dequantize as _dequantize
from loraplex.ops.triton.fp8_activations import fp8_rows
from loraplex.ops.triton.fp8_configs import MIN_DOT_M, gemm_config
from loraplex.ops.triton.gemm_tiles import row_tile
from loraplex.ops.triton.launch import pdl, wait_for_inputs
from loraplex.ops.triton.lora_common import GEMV_MAX_TOKENS
from loraplex.ops.triton.precision import INTERPRETED, dot_settings
from loraplex.ops.triton.quant_tiles import fp8_w8a8_step
from loraplex.ops.triton.split_k_sum import FusedExpand, split_k_sum

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# Weight-only steps of this many tokens or more on a GPU dequantize W into a scratch
# tensor and run cuBLAS's bf16 GEMM (the values the products see are the same): the
# tiles' bf16 MMAs wait on W's conversion, and the dequantization is one pass over W.
# Qwen3-30B-A3B's projections on an H100, us (kernel vs dequantize + cuBLAS): q/k/v at
# 128 tokens 22 vs 26, 512: 41 vs 36, 2048: 121 vs 82; o at 128: 43 vs 31; the router
# at 128: 21 vs 7. (W8A8 keeps its own kernel: its MMAs are e4m3.)
DEQUANTIZE_MIN_TOKENS = 128
# An adapted projection's decode-sized GEMM (up to GEMV_MAX_TOKENS tokens) splits K at
# least this many ways, so that its LoRA expand joins the split-K sum: one kernel after
# the GEMM instead of the expand's launch and its pass over y (Qwen3-30B-A3B W8A8's
# q/k/v, whose tuned decode config does not split K). 1: the tuned split as it is.
LORA_MIN_SPLIT_K = 2


@triton.jit
def round_to(v, DTYPE: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """float32 v rounded to DTYPE ("float32", "bfloat16", "float16"), kept in float32.
    EMULATE_BF16 (the interpreter, whose float32 -> bf16 cast truncates) rounds to
    nearest even on the bits instead."""
    if DTYPE == "float32":
        return v
    elif DTYPE == "bfloat16" and EMULATE_BF16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return bits.to(tl.float32, bitcast=True)
    elif DTYPE == "bfloat16":
        return v.to(tl.bfloat16).to(tl.float32)
    else:
        return v.to(tl.float16).to(tl.float32)


@triton.jit(do_not_specialize=["T"])
def _fp8_gemm_kernel(
    x_ptr, xs_ptr, q_ptr, s_ptr, bias_ptr, y_ptr,
    T, N, K, K_SPLIT,
    stride_xt, stride_xst, stride_qn, stride_sn, stride_yt, stride_ys,
    HAS_BIAS: tl.constexpr, SCALE_BLOCK: tl.constexpr, SCALES: tl.constexpr, SPLIT_K: tl.constexpr,
    W8A8: tl.constexpr, ACT_BLOCK: tl.constexpr,
    W_DTYPE: tl.constexpr, X_DTYPE: tl.constexpr, GEMV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    # Grouped ordering: GROUP_M consecutive row blocks sweep the column blocks together.
    pid = tl.program_id(0)
    m_blocks = tl.cdiv(T, BLOCK_M)
    n_blocks = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * n_blocks
    first_m = (pid // in_group) * GROUP_M
    group_size = tl.minimum(m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_size
    pid_n = (pid % in_group) // group_size
    # This program's K columns: all, or (SPLIT_K > 1) its split's K_SPLIT, a multiple of
    # BLOCK_K (its float32 sums go to y[split], summed by split_k_sum.py).
    k_first = tl.program_id(1) * K_SPLIT
    k_last = tl.minimum(K, k_first + K_SPLIT)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < T
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xt  # [BLOCK_M, 1]
    w_cols = q_ptr + offs_n.to(tl.int64)[None, :] * stride_qn  # W.T tile [BLOCK_K, BLOCK_N]
    s_cols = s_ptr + offs_n.to(tl.int64) * stride_sn  # [BLOCK_N]
    if SCALES == "row":  # one scale per row (per channel): loaded once
        row_scale = tl.load(s_cols, mask=n_mask, other=0.0)[None, :]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if W8A8:  # x e4m3 too: e4m3 MMAs, each step scaled by x's and W's scales (one block each)
        xs_rows = xs_ptr + offs_m.to(tl.int64) * stride_xst
        SWAP: tl.constexpr = BLOCK_M < 64  # W's rows on the MMA's M side (fp8_w8a8_step)
        if SWAP:  # the sum transposed, [BLOCK_N, BLOCK_M], until the epilogue
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(k_first, k_last, BLOCK_K):
            k = k0 + offs_k
            x = row_tile(x_rows, k, K, m_mask, 1, EVEN_K, UPCAST)
            x_scale = tl.load(xs_rows + k0 // ACT_BLOCK, mask=m_mask, other=0.0)
            acc += fp8_w8a8_step(x, x_scale, w_cols, s_cols[None, :], k, k0, K, n_mask, 1, 1, SCALE_BLOCK,
                                 EVEN_K, UPCAST, SWAP)
        if SWAP:
            acc = tl.trans(acc)
    else:  # weight-only: W dequantized to x's dtype in registers
        for k0 in range(k_first, k_last, BLOCK_K):
            k = k0 + offs_k
            if EVEN_K:
                x = tl.load(x_rows + k[None, :], mask=m_mask[:, None], other=0.0)
                q = tl.load(w_cols + k[:, None], mask=n_mask[None, :], other=0.0)
            else:
                x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & (k < K)[None, :], other=0.0)
                q = tl.load(w_cols + k[:, None], mask=n_mask[None, :] & (k < K)[:, None], other=0.0)
            wf = q.to(tl.float32)
            if SCALES == "row":
                wf = wf * row_scale
            elif SCALES == "tile":  # the tile lies in one scale block
                wf = wf * tl.load(s_cols + k0 // SCALE_BLOCK, mask=n_mask, other=0.0)[None, :]
            elif SCALES == "split":  # whole scale blocks: [BLOCK_K / SCALE_BLOCK, BLOCK_N] scales
                sb = k0 // SCALE_BLOCK + tl.arange(0, BLOCK_K // SCALE_BLOCK)
                s = tl.load(s_cols[None, :] + sb[:, None],
                            mask=n_mask[None, :] & (sb * SCALE_BLOCK < K)[:, None], other=0.0)
                wf = tl.reshape(wf, (BLOCK_K // SCALE_BLOCK, SCALE_BLOCK, BLOCK_N)) * s[:, None, :]
                wf = tl.reshape(wf, (BLOCK_K, BLOCK_N))
            else:  # "gather": a scale per element
                wf = wf * tl.load(s_cols[None, :] + (k // SCALE_BLOCK)[:, None],
                                  mask=n_mask[None, :] & (k < K)[:, None], other=0.0)
            # dequantize(W) as the oracle rounds it: to the weight's dtype, then to x's.
            w = round_to(round_to(wf, W_DTYPE, UPCAST), X_DTYPE, UPCAST)
            if GEMV:  # products and a reduction over K in registers (float32)
                acc += tl.sum(x.to(tl.float32)[:, :, None] * w[None, :, :], axis=1)
            elif UPCAST:
                acc += tl.dot(x.to(tl.float32), w, input_precision=DOT_PRECISION)
            else:
                acc += tl.dot(x, w.to(x_ptr.dtype.element_ty), input_precision=DOT_PRECISION)

    if HAS_BIAS and SPLIT_K == 1:  # (split: the sum adds it)
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if UPCAST and SPLIT_K == 1:  # the interpreter's bf16 store truncates: round first (exact after)
        acc = round_to(acc, X_DTYPE, UPCAST)
    y = y_ptr + tl.program_id(1) * stride_ys + offs_m.to(tl.int64)[:, None] * stride_yt + offs_n[None, :]
    if EVEN_N:  # rows alone masked: vector stores
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None])
    else:
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def fp8_fuses_expand(x: torch.Tensor, w: Fp8Weight) -> bool:
    """Whether fp8_linear of x can take a FusedExpand: its GEMM splits K (_split_k)."""
    t, (n, k) = x.numel() // x.shape[-1], w.shape
    a8 = w8a8(w, t)
    return (x.is_cuda and 0 < t and (a8 or t < DEQUANTIZE_MIN_TOKENS)
            and _split_k(gemm_config(n, k, x.dtype, t, x.device, w8a8=a8), t, True) > 1)


def _split_k(cfg: dict, tokens: int, lora: bool) -> int:
    """The K splits of a GEMM of `tokens` with cfg; with a LoRA expand to fuse, at least
    LORA_MIN_SPLIT_K in decode-sized steps."""
    split = cfg.get("SPLIT_K", 1)
    return max(split, LORA_MIN_SPLIT_K) if lora and tokens <= GEMV_MAX_TOKENS else split


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None,
               cfg: dict | None = None, lora: FusedExpand | None = None,
               x_fp8: Fp8Rows | None = None) -> torch.Tensor:
    """ops.linear(x, w, bias) for an Fp8Weight w [N, K]: x [..., K] -> [..., N] in x's
    dtype. `cfg` (fp8_configs.KEYS) overrides the tuned or default config. `lora`: its
    expand added in the split-K sum (the config must split K: fp8_fuses_expand).
    x_fp8: x's e4m3 rows (x [T, K]), read in W8A8 steps in place of quantizing x."""
    n, k = w.shape
    assert w.data.dim() == 2 and x.shape[-1] == k, (x.shape, w.shape)
    assert x.dtype in _DTYPES and w.dtype in _DTYPES, (x.dtype, w.dtype)
    if x.is_cuda and not _has_fp8(x.device):  # no e4m3 conversions before sm_89
        return reference_linear(x, w, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    t = x2.shape[0]
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if t == 0:
        return y.view(*lead, n)
    data, scale = w.data, w.scale
    assert data.stride(1) == 1 and scale.stride(1) == 1 and scale.dtype == torch.float32
    assert scale.shape == (n, triton.cdiv(k, w.block_k)), (scale.shape, w.block_k)
    if bias is not None:
        assert bias.shape == (n,) and bias.stride(0) == 1, bias.shape
    a8 = w8a8(w, t)
    if cfg is None and not a8 and t >= DEQUANTIZE_MIN_TOKENS and x.is_cuda and lora is None:
        return F.linear(x2, _dequantize(w).to(x.dtype), bias).view(*lead, n)
    cfg = cfg or gemm_config(n, k, x.dtype, t, x.device, w8a8=a8)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    split_k = _split_k(cfg, t, lora is not None)
    assert lora is None or split_k > 1, "a fused LoRA expand needs the split-K sum"
    if a8:  # e4m3 rows and their scales; a K step inside one block of each
        assert bm >= MIN_DOT_M and w.act_block == w.block_k, (cfg, w.act_block, w.block_k)
        bk = min(bk, w.act_block)
    xq, xs = fp8_rows(x2, w.act_block, x_fp8) if a8 else (x2, scale)
    dest = y if split_k == 1 else torch.empty(split_k, t, n, dtype=torch.float32, device=x.device)
    k_split = triton.cdiv(triton.cdiv(k, bk), split_k) * bk
    grid = (triton.cdiv(t, bm) * triton.cdiv(n, bn), split_k)
    _fp8_gemm_kernel[grid](
        xq, xs, data, scale, bias if bias is not None else scale, dest,
        t, n, k, k_split,
        xq.stride(0), xs.stride(0), data.stride(0), scale.stride(0), dest.stride(-2),
        dest.stride(0) if split_k > 1 else 0,
        HAS_BIAS=bias is not None, SCALE_BLOCK=w.block_k, SCALES=scale_mode(w.block_k, k, bk),
        SPLIT_K=split_k,
        W8A8=a8, ACT_BLOCK=max(w.act_block, 1),
        W_DTYPE=_DTYPES[w.dtype], X_DTYPE=_DTYPES[x.dtype], GEMV=bm < MIN_DOT_M,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"],
        EVEN_K=k % bk == 0, EVEN_N=n % bn == 0, **dot_settings(x.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **pdl(),
    )
    if split_k > 1:
        split_k_sum(dest, bias, y, lora)
    return y.view(*lead, n)


def scale_mode(block_k: int, k: int, block_k_tile: int) -> str:
    """How a K tile of BLOCK_K finds its scales: "row" (one block per row), "tile" (the
    tile inside one block), "split" (whole blocks, a power of 2 wide), else "gather"."""
    if block_k >= k:
        return "row"
    if block_k % block_k_tile == 0:
        return "tile"
    if block_k_tile % block_k == 0 and block_k & (block_k - 1) == 0:
        return "split"
    return "gather"


@functools.cache
def _has_fp8(device: torch.device) -> bool:
    return INTERPRETED or torch.cuda.get_device_capability(device) >= (8, 9)
