"""Checks of checkpoint tensors before they are written into a quantized weight: shape,
dtype and scales, each failure a ModelLoadError naming the tensor."""

from __future__ import annotations

import torch

from loraplex.errors import ModelLoadError


def expect(name: str, tensor: torch.Tensor, shape: tuple, dtype: torch.dtype | None = None) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise ModelLoadError(f"{name}: checkpoint shape {tuple(tensor.shape)}, expected {tuple(shape)}")
    if dtype is not None and tensor.dtype != dtype:
        raise ModelLoadError(f"{name}: checkpoint dtype {tensor.dtype}, expected {dtype}")


def finite_scales(name: str, scale: torch.Tensor) -> None:
    if not torch.isfinite(scale).all() or (scale <= 0).any():
        raise ModelLoadError(f"{name}: scales must be finite and positive")
