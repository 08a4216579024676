"""How kernels feed tl.dot.

On a GPU, bf16 operands go to the tensor cores as they are, and float32 operands use
IEEE float32 (Triton's default for float32 would be TF32, ~3 digits). The Triton
interpreter computes bf16 arithmetic wrongly, so there operands are cast to float32
first; tests on CPU then check the same kernels in bf16.
"""

from __future__ import annotations

import os

import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def dot_settings(dtype: torch.dtype) -> dict:
    """Constexpr arguments UPCAST and DOT_PRECISION for a kernel whose operands are `dtype`."""
    exact = dtype == torch.float32 or INTERPRETED
    return dict(UPCAST=INTERPRETED, DOT_PRECISION="ieee" if exact else "tf32")
