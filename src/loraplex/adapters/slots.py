"""The GPU adapter slots: stacked LoRA weights that every adapted layer reads.

For each fused projection layer (e.g. qkv_proj) there is one A tensor
[slices, max_loras, max_rank, in] and one B tensor [max_loras, out, max_rank]; slot s
of every layer holds the same adapter. Ranks below max_rank are zero-padded, and the
per-slot rank tells kernels where the real columns end. Loading an adapter is a copy
into its slot; the base weights are never touched.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from loraplex.adapters.peft import LoRAAdapter


class AdaptedProjection(Protocol):
    """What slots need to know of a model projection (see models.weights.Projection)."""

    layer: object  # a LoRALinear: .in_features, .output_sizes, .slice_rows(), .lora_a/b
    slice: int


class LoRASlotBuffers:
    def __init__(
        self,
        projections: Mapping[str, AdaptedProjection],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.projections = projections
        self.max_loras = max_loras
        self.ranks = [0] * max_loras  # rank of the adapter in each slot, 0 = empty
        self.layers = list({id(p.layer): p.layer for p in projections.values()}.values())
        for layer in self.layers:
            n_slices = len(layer.output_sizes)
            layer.lora_a = torch.zeros(
                n_slices, max_loras, max_rank, layer.in_features, dtype=dtype, device=device
            )
            layer.lora_b = torch.zeros(
                max_loras, sum(layer.output_sizes), max_rank, dtype=dtype, device=device
            )

    @property
    def nbytes(self) -> int:
        return sum(layer.lora_a.nbytes + layer.lora_b.nbytes for layer in self.layers)

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy `adapter` into `slot`, replacing whatever was there."""
        self.clear(slot)
        for module, (a, b) in adapter.weights.items():
            proj = self.projections[module]
            r = a.shape[0]
            proj.layer.lora_a[proj.slice, slot, :r].copy_(a, non_blocking=True)
            proj.layer.lora_b[slot, proj.layer.slice_rows(proj.slice), :r].copy_(b, non_blocking=True)
        self.ranks[slot] = adapter.rank

    def clear(self, slot: int) -> None:
        for layer in self.layers:
            layer.lora_a[:, slot].zero_()
            layer.lora_b[slot].zero_()
        self.ranks[slot] = 0
