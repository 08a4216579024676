"""RMSNorm: normalise in float32, then scale by w (Llama, Qwen, Mistral) or by 1 + w
(Gemma, `unit_offset`, whose weights start at zero). In front of a W8A8 GEMM the norm
also writes its output's e4m3 rows (`with_fp8`), so the GEMM launches no quantization."""

from __future__ import annotations

import torch
from torch import nn

from loraplex import ops
from loraplex.ops.formats import Fp8Rows


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(size) if unit_offset else torch.ones(size), False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with a residual: (norm(x + residual), x + residual)."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps, self.unit_offset)
        return ops.add_rms_norm(x, residual, self.weight, self.eps, self.unit_offset)

    def with_fp8(self, x: torch.Tensor, residual: torch.Tensor | None, fp8_block: int
                 ) -> tuple[torch.Tensor, torch.Tensor, Fp8Rows | None]:
        """A decoder layer's norm: (norm(x + residual), x + residual, the norm's e4m3 rows
        in blocks of fp8_block for the W8A8 GEMM that reads it, from the same launch; None
        where fp8_block is 0). residual None: norm(x), x."""
        if residual is None:
            out = ops.rms_norm(x, self.weight, self.eps, self.unit_offset, fp8_block)
            y, rows = out if fp8_block else (out, None)
            return y, x, rows
        out = ops.add_rms_norm(x, residual, self.weight, self.eps, self.unit_offset, fp8_block)
        return out if fp8_block else (*out, None)
