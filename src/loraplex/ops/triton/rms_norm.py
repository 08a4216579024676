"""RMSNorm, optionally fused with the residual add that precedes it.

One program per row. With a residual, the sum x + residual is rounded to the model dtype
(as the unfused model computes it), stored as the new residual stream, and normalised in
float32; the normalised row is rounded before the weight multiplies it, as in Hugging
Face's Llama RMSNorm, or (UNIT_OFFSET, Gemma) scaled by 1 + weight in float32 and then
rounded. Rows may be (token, head) pairs of a strided [T, H, D] view (q/k norm). With a
residual, x may be [T, K, N]: a MoE block's K expert outputs per token, summed here (one
launch and one pass over them less than a separate sum).
With FP8_BLOCK (a W8A8 GEMM reads the output: ops/formats Fp8Rows), the program also
writes its row's e4m3 values and per-block scales (fp8_activations.e4m3_rows, bit for bit
quantize_activations of the rounded row): the GEMM's own quantization launch, gone.

Training (train/norms.py, a frozen weight): `rms_norm_train` also writes each row's
float32 rstd, in one of transformers' three roundings (ops.rms_norm_train), and
`rms_norm_backward` gives dx from x and rstd, with no weight gradient. Several short rows
(q/k norm heads) per program; rows of any leading shape and strides, in memory order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.ops.formats import Fp8Rows
from loraplex.ops.triton.fp8_activations import e4m3_rows
from loraplex.ops.triton.launch import pdl, wait_for_inputs
from loraplex.ops.triton.precision import INTERPRETED
from loraplex.ops.triton.quant_tiles import operand


@triton.jit
def scale_normed(x, w, dtype, UNIT_OFFSET: tl.constexpr):
    """x * rstd (float32) times the norm weight, rounded as the model rounds it: Llama
    rounds to `dtype` first, Gemma (UNIT_OFFSET) scales by 1 + w in float32. The result
    is float32, still to be rounded. Shared with the rotary kernel's q/k norm."""
    if UNIT_OFFSET:
        return x * (1.0 + w)
    return x.to(dtype).to(tl.float32) * w


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, q_ptr, s_ptr,
    N, eps,
    stride_x0, stride_x1, stride_r0, stride_o0, stride_o1, stride_q0, stride_s0,
    INNER: tl.constexpr, HAS_RESIDUAL: tl.constexpr, UNIT_OFFSET: tl.constexpr,
    SUM_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, FP8_BLOCK: tl.constexpr, HAND_ROUND: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    outer, inner = row // INNER, row % INNER
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    x = tl.load(x_ptr + outer * stride_x0 + inner * stride_x1 + offs, mask=mask, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    if SUM_ROWS > 1:  # x [T, SUM_ROWS, N] (INNER 1): the row's terms, summed and rounded
        for j in tl.static_range(1, SUM_ROWS):
            term = tl.load(x_ptr + outer * stride_x0 + j * stride_x1 + offs, mask=mask, other=0.0)
            x += term.to(tl.float32)
        x = x.to(dtype).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r0 + offs, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(dtype)
        tl.store(res_out_ptr + row * stride_r0 + offs, x, mask=mask)
        x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = scale_normed(x * rstd, w, dtype, UNIT_OFFSET).to(dtype)
    tl.store(out_ptr + outer * stride_o0 + inner * stride_o1 + offs, y, mask=mask)
    if FP8_BLOCK == BLOCK_N:  # the rounded row is one block (padding columns are 0)
        v, scale = e4m3_rows(y.to(tl.float32)[None, :], HAND_ROUND)
        tl.store(q_ptr + row * stride_q0 + offs[None, :], v.to(q_ptr.dtype.element_ty), mask=mask[None, :])
        tl.store(s_ptr + row * stride_s0 + tl.arange(0, 1), scale)
    elif FP8_BLOCK > 0:  # the rounded row as [blocks, FP8_BLOCK]
        v, scale = e4m3_rows(tl.reshape(y.to(tl.float32), (BLOCK_N // FP8_BLOCK, FP8_BLOCK)), HAND_ROUND)
        tl.store(q_ptr + row * stride_q0 + offs, tl.reshape(v, (BLOCK_N,)).to(q_ptr.dtype.element_ty),
                 mask=mask)
        groups = tl.arange(0, BLOCK_N // FP8_BLOCK)
        tl.store(s_ptr + row * stride_s0 + groups, scale, mask=groups * FP8_BLOCK < N)



def _launch(x, residual, weight, eps, unit_offset, fp8_block=0):
    n = x.shape[-1]
    assert x.stride(-1) == 1 and weight.shape == (n,), (x.stride(), weight.shape)
    x3 = x if x.dim() == 3 else x.unsqueeze(1)  # [outer, inner, N]
    # With a residual, a 3-D x holds terms to sum per row; without, rows of heads to norm.
    sum_rows = x3.shape[1] if residual is not None else 1
    out_shape = (x3.shape[0], 1 if sum_rows > 1 else x3.shape[1], n)
    out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(residual) if residual is not None else None
    if residual is not None:
        assert residual.shape == (x3.shape[0], n) and residual.stride(-1) == 1, (x.shape, residual.shape)
    rows = out_shape[0] * out_shape[1]
    block_n = triton.next_power_of_2(n)
    fp8 = None
    if fp8_block:  # rows of a [T, N] output, blocks of a power of 2 that tile BLOCK_N
        assert out_shape[1] == 1 and fp8_block & (fp8_block - 1) == 0 and fp8_block <= block_n, (
            x.shape, fp8_block)
        fp8 = Fp8Rows.empty(rows, n, fp8_block, x.device)
    if rows:
        _rms_norm_kernel[(rows,)](
            x3, residual if residual is not None else x3, weight, out,
            res_out if res_out is not None else out,
            fp8.q if fp8 else out, fp8.scale if fp8 else out,
            n, eps,
            x3.stride(0), x3.stride(1),
            residual.stride(0) if residual is not None else 0,
            out.stride(0), out.stride(1),
            fp8.q.stride(0) if fp8 else 0, fp8.scale.stride(0) if fp8 else 0,
            INNER=out_shape[1], HAS_RESIDUAL=residual is not None, UNIT_OFFSET=unit_offset,
            SUM_ROWS=sum_rows, BLOCK_N=block_n, FP8_BLOCK=fp8_block, HAND_ROUND=INTERPRETED,
            num_warps=4 if n <= 4096 else 8,
            **pdl(),
        )
    return out.view(x.shape if residual is None else residual.shape), res_out, fp8


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False,
             fp8_block: int = 0):
    out, _, fp8 = _launch(x, None, weight, eps, unit_offset, fp8_block)
    return (out, fp8) if fp8_block else out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    unit_offset: bool = False, fp8_block: int = 0,
):
    out, res_out, fp8 = _launch(x, residual, weight, eps, unit_offset, fp8_block)
    return (out, res_out, fp8) if fp8_block else (out, res_out)


# Training (LoRA over a frozen base; train/norms.py): the forward also writes each row's
# float32 rstd, and the backward gives dx only (the weight is frozen). Modes, numbered as
# the kernels' MODE: how transformers rounds (ops.rms_norm_train).
TRAIN_MODES = {"llama": 0, "fp32_weight": 1, "unit_offset": 2}


@triton.jit
def _rms_norm_train_kernel(
    x_ptr, w_ptr, y_ptr, rstd_ptr, R, N, eps, stride_x, stride_y,
    MODE: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < R
    mask = row_mask[:, None] & (cols < N)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    xhat = x * rstd[:, None]
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if MODE == 0:  # Llama: xhat rounded to x's dtype, then times w
        y = operand(xhat, x_ptr, UPCAST).to(tl.float32) * w
    elif MODE == 1:  # gpt-oss: w * xhat in float32
        y = xhat * w
    else:  # Gemma: (1 + w) in float32
        y = xhat * (1.0 + w)
    y = operand(y, y_ptr, UPCAST)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def _rms_norm_backward_kernel(
    g_ptr, x_ptr, rstd_ptr, w_ptr, dx_ptr, R, N, stride_g, stride_x, stride_dx,
    MODE: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """dx = rstd (gxhat - xhat mean(gxhat xhat)), gxhat = g w (g (1 + w) for Gemma): the
    rounding of the forward passes gradients through unchanged."""
    wait_for_inputs(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < R)[:, None] & (cols < N)[None, :]
    g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + rows, mask=rows < R, other=0.0)[:, None]
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if MODE == 2:
        gxhat = g * (1.0 + w)
    else:
        gxhat = g * w
    xhat = x * rstd
    dx = rstd * (gxhat - xhat * (tl.sum(gxhat * xhat, axis=1) / N)[:, None])
    dx = operand(dx, dx_ptr, UPCAST)
    tl.store(dx_ptr + rows[:, None] * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _row_order(x: torch.Tensor) -> list[int] | None:
    """x's dims in memory order (leading dims by decreasing stride, the last dim last), so
    that x permuted so is a [rows, N] view where its layout allows (a q/k norm's transposed
    [B, H, S, D] heads, a split's slice of a wider row), else reshape copies it. None for
    a contiguous x (rows as they are, fewer host-side ops)."""
    if x.is_contiguous():
        return None
    lead = sorted(range(x.dim() - 1), key=lambda d: -x.stride(d))
    return [*lead, x.dim() - 1]


def _rows(t: torch.Tensor, order: list[int] | None) -> torch.Tensor:
    r = (t if order is None else t.permute(order)).reshape(-1, t.shape[-1])
    return r if r.stride(-1) == 1 else r.contiguous()


def _empty_rows(x: torch.Tensor, order: list[int] | None, dtype: torch.dtype, last: bool = True):
    """A new tensor shaped as x (without its last dim if not `last`), laid out in x's row
    order: (it, its [rows, N] or [rows] view)."""
    if order is None:
        buf = torch.empty(x.shape if last else x.shape[:-1], dtype=dtype, device=x.device)
        return buf, buf.view(-1, x.shape[-1]) if last else buf.view(-1)
    dims = order if last else order[:-1]
    buf = torch.empty([x.shape[d] for d in dims], dtype=dtype, device=x.device)
    inverse = sorted(range(len(dims)), key=lambda i: dims[i])
    return buf.permute(inverse), buf.view(-1, x.shape[-1]) if last else buf.view(-1)


def _blocks(n: int) -> dict:
    block_n = triton.next_power_of_2(n)
    # Several short rows (q/k norm heads) per program; one long row (hidden states) each.
    return dict(BLOCK_M=max(1, min(16, 2048 // block_n)), BLOCK_N=block_n,
                num_warps=4 if block_n <= 4096 else 8)


def rms_norm_train(x: torch.Tensor, weight: torch.Tensor, eps: float, mode: str):
    n = x.shape[-1]
    assert weight.shape == (n,) and weight.stride(0) == 1, (x.shape, weight.shape)
    order = _row_order(x)
    xr = _rows(x, order)
    out_dtype = torch.result_type(weight, x) if mode == "llama" else x.dtype
    y, yr = _empty_rows(x, order, out_dtype)
    rstd, rstd_r = _empty_rows(x, order, torch.float32, last=False)
    cfg = _blocks(n)
    if xr.shape[0]:
        _rms_norm_train_kernel[(triton.cdiv(xr.shape[0], cfg["BLOCK_M"]),)](
            xr, weight, yr, rstd_r, xr.shape[0], n, eps, xr.stride(0), yr.stride(0),
            MODE=TRAIN_MODES[mode], UPCAST=INTERPRETED, **cfg,
            **pdl(),
        )
    return y, rstd


def rms_norm_backward(g: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor,
                      mode: str) -> torch.Tensor:
    n = x.shape[-1]
    order = _row_order(x)
    xr, gr = _rows(x, order), _rows(g, order)
    rstd_r = (rstd if order is None else rstd.permute(order[:-1])).reshape(-1)  # as laid out: a view
    dx, dxr = _empty_rows(x, order, x.dtype)
    cfg = _blocks(n)
    if xr.shape[0]:
        _rms_norm_backward_kernel[(triton.cdiv(xr.shape[0], cfg["BLOCK_M"]),)](
            gr, xr, rstd_r, weight, dxr, xr.shape[0], n, gr.stride(0), xr.stride(0), dxr.stride(0),
            MODE=TRAIN_MODES[mode], UPCAST=INTERPRETED, **cfg,
            **pdl(),
        )
    return dx
