"""A frozen quantized base weight for LoRA training: it stays in its checkpoint's format
(ops/formats) on the device and each use dequantizes it for that use only.

- `QuantizedLinear`, a linear layer, dequantizes W in its forward and again in its
  backward (dx = dy W); it saves nothing of W.
- `FrozenWeight.experts` gives an experts module's stack to the expert autograd
  functions (train/expert_gemm.py StackSlices), which dequantize it a slice of experts at a time,
  forward and backward alike.
With gradient checkpointing a step then holds one layer's bf16 weights (experts: one
slice) at a time beside the quantized model. train/quantized_base.py builds such a model
from a checkpoint.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loraplex import ops
from loraplex.ops.formats import QuantizedWeight
from loraplex.ops.formats.checkpoint import leading_slice, row_parts
from loraplex.ops.reference.quant import dequantize
from loraplex.train.expert_gemm import StackSlices

# Bytes of dequantized experts an expert GEMM makes at once (gpt-oss-20b: 8 of a layer's
# 32 gate/up matrices).
EXPERT_SLICE_BYTES = 256 << 20
# Values the CPU dequantizes at once (float32 temporaries of a few times this many bytes).
_DEQUANT_CHUNK = 1 << 22


class FrozenWeight(nn.Module):
    """A frozen base weight held quantized: `w()` gives it in the model's dtype, in the
    layout the transformers module reads (`transposed`: [..., K, N], the transpose of the
    canonical [..., N, K]): on a GPU by one kernel, elsewhere in row chunks so that the
    reference's float32 temporaries stay small."""

    def __init__(self, qweight: QuantizedWeight, transposed: bool = False):
        super().__init__()
        self.qweight, self.transposed = qweight, transposed

    @property
    def shape(self) -> torch.Size:
        s = self.qweight.shape
        return torch.Size((*s[:-2], s[-1], s[-2])) if self.transposed else s

    @property
    def dtype(self) -> torch.dtype:
        return self.qweight.dtype

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def forward(self) -> torch.Tensor:
        w = self.qweight
        if w.device.type == "cuda":  # one kernel, no temporaries (ops/triton/dequantize.py)
            out = ops.backend_for(w.device).dequantize(w)
            return out.transpose(-1, -2) if self.transposed else out
        k = w.shape[-1]
        out = torch.empty(w.shape, dtype=w.dtype, device=w.device)
        rows = out.view(-1, k)
        for r0, r1, part in row_parts(w, max(1, _DEQUANT_CHUNK // k)):
            rows[r0:r1] = dequantize(part)
        return out.transpose(-1, -2) if self.transposed else out

    def experts(self, transpose: bool) -> StackSlices:
        """An expert stack as the expert functions read it (train/expert_gemm.py StackSlices):
        experts made a slice at a time, [E, K, N] (canonical [E, N, K] transposed) if
        `transpose`, about EXPERT_SLICE_BYTES of them at once."""
        w = self.qweight
        e, n, k = w.shape

        def make(e0: int, e1: int) -> torch.Tensor:
            part = FrozenWeight(leading_slice(w, e0, e1))()
            return part.transpose(1, 2) if transpose else part

        chunk = max(1, EXPERT_SLICE_BYTES // (n * k * w.dtype.itemsize))
        return StackSlices(make, (e, k, n) if transpose else (e, n, k), chunk)


class _FrozenMatmul(torch.autograd.Function):
    """x W^T + bias for a frozen quantized W: W dequantized in the forward and again in
    the backward, never saved (one layer's bf16 W exists only while it is used)."""

    @staticmethod
    def forward(ctx, x, weight: FrozenWeight, bias):
        ctx.weight = weight
        return F.linear(x, weight().to(x.dtype), bias)

    @staticmethod
    def backward(ctx, g):
        return g @ ctx.weight().to(g.dtype), None, None


class QuantizedLinear(nn.Module):
    """nn.Linear's interface (in_features, out_features, weight, bias) over a frozen
    quantized weight."""

    def __init__(self, weight: FrozenWeight, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FrozenMatmul.apply(x, self.weight, self.bias)
