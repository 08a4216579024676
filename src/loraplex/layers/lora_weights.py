"""The adapter slots a layer reads: the one contract between adapters/slots.py, which
allocates and fills them, and the layers that own them (`LoRALinear.lora`,
`Experts.lora`). Slot s of every tensor holds the adapter loaded into GPU slot s; ranks
below the capacity are zero-padded, and each adapter's scaling is folded into B.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LoRAWeights:
    """A fused projection's slots (slices: the projections fused in it, e.g. q/k/v)."""

    a: torch.Tensor  # [slices, max_loras, max_rank, in]
    b: torch.Tensor  # [max_loras, out, max_rank]
    # DoRA, once a DoRA adapter is loaded: [max_loras + 1, out] float32 row scales
    # m / ||W + s B A|| per slot (1 where a slot's adapter is not DoRA); the last row,
    # all ones, is for base-model tokens.
    dora_scale: torch.Tensor | None = None

    @classmethod
    def zeros(cls, slices: int, in_features: int, out_features: int, max_loras: int, max_rank: int,
              dtype: torch.dtype, device: torch.device) -> LoRAWeights:
        return cls(torch.zeros(slices, max_loras, max_rank, in_features, dtype=dtype, device=device),
                   torch.zeros(max_loras, out_features, max_rank, dtype=dtype, device=device))


@dataclass
class ExpertLoRAWeights:
    """An experts module's slots: per slot and expert, the gate_up and down A and B
    (layout in ops.MoELoRA). The gate_up capacity is 2 x max_rank: per-expert
    gate_proj / up_proj adapters stack their two ranks there."""

    a_gate_up: torch.Tensor  # [max_loras, E, 2 max_rank, H]
    b_gate_up: torch.Tensor  # [max_loras, E, 2I, 2 max_rank]
    a_down: torch.Tensor  # [max_loras, E, max_rank, I]
    b_down: torch.Tensor  # [max_loras, E, H, max_rank]
    slot_mask: torch.Tensor  # [max_loras] int32: 1 where the slot's adapter adapts these experts
    ranks: torch.Tensor  # [2, max_loras] int32: each slot's gate_up and down rank
    # The slots of slot_mask, on the host: a step none of whose tokens use one skips the
    # expert LoRA path without reading the device.
    slots: set[int] = field(default_factory=set)

    @classmethod
    def zeros(cls, num_experts: int, hidden: int, intermediate: int, max_loras: int, max_rank: int,
              dtype: torch.dtype, device: torch.device) -> ExpertLoRAWeights:
        def z(*shape):
            return torch.zeros(max_loras, num_experts, *shape, dtype=dtype, device=device)

        return cls(z(2 * max_rank, hidden), z(2 * intermediate, 2 * max_rank), z(max_rank, intermediate),
                   z(hidden, max_rank), torch.zeros(max_loras, dtype=torch.int32, device=device),
                   torch.zeros(2, max_loras, dtype=torch.int32, device=device))

    def pairs(self) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """(A, B) of gate_up, then of down."""
        return (self.a_gate_up, self.b_gate_up), (self.a_down, self.b_down)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for pair in self.pairs() for t in pair)
