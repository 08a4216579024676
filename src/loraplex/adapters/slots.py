"""The GPU adapter slots: stacked LoRA weights that every adapted layer reads.

For each fused projection layer (e.g. qkv_proj) there is one A tensor
[slices, max_loras, max_rank, in] and one B tensor [max_loras, out, max_rank]; slot s
of every layer holds the same adapter. Ranks below max_rank are zero-padded, and the
per-slot rank tells kernels where the real columns end. Loading an adapter is a copy
into its slot; the base weights are never touched. Columns past an adapter's rank must
be zero (the reference ops and a projection the adapter does not target read them), so
a load zeroes exactly what the slot's previous adapter wrote beyond the new one.

MoE experts modules get four more tensors per module, one per expert in every slot
(layout in ops.MoELoRA); the gate_up rank capacity is 2 x max_rank, as per-expert
gate_proj/up_proj adapters stack their two ranks there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from torch import nn

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
        experts: Mapping[str, nn.Module] | None = None,
    ):
        self.projections = projections
        self.experts = dict(experts or {})  # experts module path -> models.moe.Experts
        self.max_loras = max_loras
        self.ranks = [0] * max_loras  # rank of the adapter in each slot, 0 = empty
        self._layer_by_id = {id(p.layer): p.layer for p in projections.values()}
        self.layers = list(self._layer_by_id.values())
        self.max_loras = max_loras
        self.dora_slots: set[int] = set()  # slots holding a DoRA adapter
        # Per slot: (layer id, slice) or (experts path, 0 gate_up / 1 down) -> rank of the
        # columns last written there.
        self._written: list[dict[tuple, int]] = [{} for _ in range(max_loras)]
        for layer in self.layers:
            n_slices = len(layer.output_sizes)
            layer.lora_a = torch.zeros(
                n_slices, max_loras, max_rank, layer.in_features, dtype=dtype, device=device
            )
            layer.lora_b = torch.zeros(
                max_loras, sum(layer.output_sizes), max_rank, dtype=dtype, device=device
            )
        for x in self.experts.values():
            e, h, i = x.num_experts, x.hidden_size, x.intermediate_size
            zeros = lambda *shape: torch.zeros(max_loras, e, *shape, dtype=dtype, device=device)  # noqa: E731
            x.lora_a_gate_up, x.lora_b_gate_up = zeros(2 * max_rank, h), zeros(2 * i, 2 * max_rank)
            x.lora_a_down, x.lora_b_down = zeros(max_rank, i), zeros(h, max_rank)
            x.lora_slot_mask = torch.zeros(max_loras, dtype=torch.int32, device=device)

    @property
    def nbytes(self) -> int:
        return sum(layer.lora_a.nbytes + layer.lora_b.nbytes for layer in self.layers) + sum(
            t.nbytes for x in self.experts.values() for t in _expert_slots(x))

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy `adapter` into `slot` (asynchronously from pinned memory, on the current
        stream). Only what the previous occupant left beyond the new ranks is zeroed."""
        written = {}
        for module, (a, b) in adapter.weights.items():
            proj = self.projections[module]
            layer, r = proj.layer, a.shape[0]
            layer.lora_a[proj.slice, slot, :r].copy_(a, non_blocking=True)
            layer.lora_b[slot, layer.slice_rows(proj.slice), :r].copy_(b, non_blocking=True)
            written[(id(layer), proj.slice)] = r
        for path, x in self.experts.items():
            ex = adapter.experts.get(path)
            if ex is None:
                if slot in x.lora_slots:
                    x.lora_slots.discard(slot)
                    x.lora_slot_mask[slot] = 0
                continue
            x.lora_slots.add(slot)
            x.lora_slot_mask[slot] = 1
            for i, (a, b, sa, sb) in enumerate(((ex.a_gate_up, ex.b_gate_up, x.lora_a_gate_up, x.lora_b_gate_up),
                                                (ex.a_down, ex.b_down, x.lora_a_down, x.lora_b_down))):
                if a is not None:
                    r = a.shape[1]
                    sa[slot, :, :r].copy_(a, non_blocking=True)
                    sb[slot, :, :, :r].copy_(b, non_blocking=True)
                    written[(path, i)] = r
        for (owner, i), old_r in self._written[slot].items():
            r = written.get((owner, i), 0)
            if old_r <= r:
                continue
            if owner in self.experts:
                sa, sb = _expert_slots(self.experts[owner])[2 * i : 2 * i + 2]
                sa[slot, :, r:old_r].zero_()
                sb[slot, :, :, r:old_r].zero_()
            else:
                layer = self._layer_by_id[owner]
                layer.lora_a[i, slot, r:old_r].zero_()
                layer.lora_b[slot, layer.slice_rows(i), r:old_r].zero_()
        self._written[slot] = written
        self.ranks[slot] = adapter.rank
        if slot in self.dora_slots:
            for layer in self.layers:
                if layer.lora_scale is not None:
                    layer.lora_scale[slot] = 1.0
            self.dora_slots.discard(slot)
        if adapter.magnitudes:
            self._load_dora(slot, adapter)

    def _load_dora(self, slot: int, adapter: LoRAAdapter) -> None:
        """Row scales m / ||W + s B A|| (PEFT's DoRA), from the weights now in the slot:
        ||W + BA||^2 = ||W||^2 + 2 rowsum((W A^T) * B) + rowsum((B A A^T) * B), so the
        dense delta B A is never formed (B already carries the scaling s)."""
        for module, mag in adapter.magnitudes.items():
            proj = self.projections[module]
            layer, rows = proj.layer, proj.layer.slice_rows(proj.slice)
            r = adapter.weights[module][0].shape[0]
            a = layer.lora_a[proj.slice, slot, :r].float()
            b = layer.lora_b[slot, rows, :r].float()
            w = layer.weight[rows]
            wa = (w @ a.to(w.dtype).T).float()
            norm2 = (torch.linalg.vector_norm(w, dim=1, dtype=torch.float32) ** 2
                     + 2 * (wa * b).sum(1) + ((b @ (a @ a.T)) * b).sum(1))
            if layer.lora_scale is None:
                layer.lora_scale = torch.ones(self.max_loras + 1, layer.weight.shape[0],
                                              dtype=torch.float32, device=layer.weight.device)
            layer.lora_scale[slot, rows] = mag.to(layer.lora_scale.device, non_blocking=True) / norm2.sqrt()
        self.dora_slots.add(slot)

    def clear(self, slot: int) -> None:
        for layer in self.layers:
            layer.lora_a[:, slot].zero_()
            layer.lora_b[slot].zero_()
        for x in self.experts.values():
            for t in _expert_slots(x):
                t[slot].zero_()
            x.lora_slots.discard(slot)
            x.lora_slot_mask[slot] = 0
        self._written[slot] = {}
        self.ranks[slot] = 0
        for layer in self.layers:
            if layer.lora_scale is not None:
                layer.lora_scale[slot] = 1.0
        self.dora_slots.discard(slot)


def _expert_slots(x: nn.Module) -> tuple[torch.Tensor, ...]:
    return x.lora_a_gate_up, x.lora_b_gate_up, x.lora_a_down, x.lora_b_down
