"""RMSNorm: normalise in float32, then scale by w (Llama, Qwen, Mistral) or by 1 + w
(Gemma, `unit_offset`, whose weights start at zero)."""

from __future__ import annotations

import torch
from torch import nn

from loraplex import ops


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
