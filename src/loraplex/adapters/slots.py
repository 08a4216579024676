"""The GPU adapter slots: stacked LoRA weights that every adapted layer reads.

Each adapted layer owns its slots (layers/lora_weights.py: a LoRAWeights per fused
projection layer, e.g. qkv_proj, with one A [slices, max_loras, max_rank, in] and one B
[max_loras, out, max_rank]; an ExpertLoRAWeights per experts module, layout in
ops.MoELoRA); this module allocates and fills them. Slot s of every layer holds the same
adapter. Ranks below max_rank are zero-padded, and the per-slot rank tells kernels where
the real columns end. Loading an adapter is a copy into its slot; the base weights are
never touched. Columns past an adapter's rank must be zero (the reference ops and a
projection the adapter does not target read them), so a load zeroes exactly what the
slot's previous adapter wrote beyond the new one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Protocol

import torch
from torch import nn

from loraplex.adapters.peft import LoRAAdapter
from loraplex.adapters.safetensors_io import TensorFile
from loraplex.layers.lora_weights import ExpertLoRAWeights, LoRAWeights


class AdaptedProjection(Protocol):
    """What slots need to know of a model projection (see models.weights.Projection)."""

    layer: object  # a LoRALinear: .in_features, .output_sizes, .slice_rows(), .lora
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
        self.experts = dict(experts or {})  # experts module path -> layers.moe.Experts
        self.max_loras = max_loras
        self.ranks = [0] * max_loras  # rank of the adapter in each slot, 0 = empty
        self._layer_by_id = {id(p.layer): p.layer for p in projections.values()}
        self.layers = list(self._layer_by_id.values())
        self.max_loras = max_loras
        self.dora_slots: set[int] = set()  # slots holding a DoRA adapter
        self.router_slots: set[int] = set()  # slots whose adapter adapts an MoE router
        self.has_routers = any(layer.is_router for layer in self.layers)
        # Per slot: (layer id, slice) or (experts path, 0 gate_up / 1 down) -> rank of the
        # columns last written there.
        self._written: list[dict[tuple, int]] = [{} for _ in range(max_loras)]
        self._views: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.staging = Staging()
        self.split = any(layer.tp is not None for layer in self.layers)  # tensor parallel
        for layer in self.layers:
            layer.lora = LoRAWeights.zeros(len(layer.output_sizes), layer.in_features,
                                           sum(layer.output_sizes), max_loras, max_rank, dtype, device)
        for x in self.experts.values():
            x.lora = ExpertLoRAWeights.zeros(x.num_experts, x.hidden_size, x.intermediate_size,
                                             max_loras, max_rank, dtype, device)

    @property
    def nbytes(self) -> int:
        return sum(layer.lora.a.nbytes + layer.lora.b.nbytes for layer in self.layers) + sum(
            x.lora.nbytes for x in self.experts.values())

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy `adapter` into `slot` (asynchronously from pinned memory, on the current
        stream). Only what the previous occupant left beyond the new ranks is zeroed."""
        written = {}
        dsts, names, scales = [], [], []
        for module, (a_name, b_name, scale) in adapter.modules.items():
            proj = self.projections[module]
            r = adapter.shape(a_name)[0]
            dsts += self._slot_views(proj.layer, proj.slice, slot, r)
            names += (a_name, b_name)
            scales += (1.0, scale)
            written[(id(proj.layer), proj.slice)] = r
        if self.split:  # tensor parallel: this rank's part of A (row layers) or B (column)
            srcs = []
            projections = map(self.projections.get, adapter.modules)
            for a_name, b_name, proj in zip(names[::2], names[1::2], projections):
                a, b, tp = adapter.tensors[a_name], adapter.tensors[b_name], proj.layer.tp
                srcs += (a, b) if tp is None else (tp.lora_a(a), tp.lora_b(proj.slice, b))
            self.staging.copy(dsts, srcs, scales)
        else:
            self.staging.copy_from_file(dsts, adapter.tensors, names, scales)
        dsts, srcs = [], []
        for path, x in self.experts.items():
            w, ex = x.lora, adapter.experts.get(path)
            if ex is None:
                if slot in w.slots:
                    w.slots.discard(slot)
                    w.slot_mask[slot] = 0
                    w.ranks[:, slot] = 0
                continue
            w.slots.add(slot)
            w.slot_mask[slot] = 1
            ranks = [0, 0]
            pairs = ((ex.a_gate_up, ex.b_gate_up), (ex.a_down, ex.b_down))
            for i, ((a, b), (sa, sb)) in enumerate(zip(pairs, w.pairs())):
                if a is not None:
                    r = ranks[i] = a.shape[1]
                    # expert B carries its scaling (re-laid out on load)
                    d, s = _expert_parts(x.tp, i, sa[slot, :, :r], sb[slot, :, :, :r], a, b)
                    dsts += d
                    srcs += s
                    written[(path, i)] = r
            # the kernels read A and B up to these ranks (the slot's capacity is 2 x max rank
            # for gate_up: PEFT's fused layout uses half of it)
            w.ranks[0, slot], w.ranks[1, slot] = ranks  # fills on the device, no sync
        self.staging.copy(dsts, srcs, [1.0] * len(srcs))
        for (owner, i), old_r in self._written[slot].items():
            r = written.get((owner, i), 0)
            if old_r <= r:
                continue
            if owner in self.experts:
                sa, sb = self.experts[owner].lora.pairs()[i]
                sa[slot, :, r:old_r].zero_()
                sb[slot, :, :, r:old_r].zero_()
            else:
                layer = self._layer_by_id[owner]
                layer.lora.a[i, slot, r:old_r].zero_()
                layer.lora.b[slot, layer.slice_rows(i), r:old_r].zero_()
        self._written[slot] = written
        self.ranks[slot] = adapter.rank
        if any(self.projections[m].layer.is_router for m in adapter.modules):
            self.router_slots.add(slot)
        else:
            self.router_slots.discard(slot)
        if slot in self.dora_slots:
            for layer in self.layers:
                if layer.lora.dora_scale is not None:
                    layer.lora.dora_scale[slot] = 1.0
            self.dora_slots.discard(slot)
        if adapter.magnitudes:
            self._load_dora(slot, adapter)

    def _slot_views(self, layer, i: int, slot: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot `slot`'s A [r, in] and B [out, r] of slice i of `layer`: built once (a
        load would otherwise spend ~10 us of Python per view, 448 views for Llama-8B)."""
        key = (id(layer), i, slot, r)
        views = self._views.get(key)
        if views is None:
            views = (layer.lora.a[i, slot, :r], layer.lora.b[slot, layer.slice_rows(i), :r])
            self._views[key] = views
        return views

    def _load_dora(self, slot: int, adapter: LoRAAdapter) -> None:
        """Row scales m / ||W + s B A|| (PEFT's DoRA), from the weights now in the slot:
        ||W + BA||^2 = ||W||^2 + 2 rowsum((W A^T) * B) + rowsum((B A A^T) * B), so the
        dense delta B A is never formed (B already carries the scaling s)."""
        for module, mag in adapter.magnitudes.items():
            proj = self.projections[module]
            layer, rows = proj.layer, proj.layer.slice_rows(proj.slice)
            r = adapter.shape(adapter.modules[module][0])[0]
            a = layer.lora.a[proj.slice, slot, :r].float()
            b = layer.lora.b[slot, rows, :r].float()
            w = layer.weight[rows]
            wa = (w @ a.to(w.dtype).T).float()
            norm2 = (torch.linalg.vector_norm(w, dim=1, dtype=torch.float32) ** 2
                     + 2 * (wa * b).sum(1) + ((b @ (a @ a.T)) * b).sum(1))
            if layer.lora.dora_scale is None:
                layer.lora.dora_scale = torch.ones(self.max_loras + 1, layer.weight.shape[0],
                                                   dtype=torch.float32, device=layer.weight.device)
            scale = layer.lora.dora_scale
            scale[slot, rows] = mag.to(scale.device, non_blocking=True) / norm2.sqrt()
        self.dora_slots.add(slot)

    def clear(self, slot: int) -> None:
        for layer in self.layers:
            layer.lora.a[:, slot].zero_()
            layer.lora.b[slot].zero_()
        for x in self.experts.values():
            w = x.lora
            for a, b in w.pairs():
                a[slot].zero_()
                b[slot].zero_()
            w.slots.discard(slot)
            w.slot_mask[slot] = 0
            w.ranks[:, slot] = 0
        self._written[slot] = {}
        self.ranks[slot] = 0
        for layer in self.layers:
            if layer.lora.dora_scale is not None:
                layer.lora.dora_scale[slot] = 1.0
        self.dora_slots.discard(slot)


def _expert_parts(tp, i: int, sa, sb, a, b) -> tuple[list, list]:
    """Slot views and adapter tensors to copy into them for gate_up (i = 0) or down (1):
    under tensor parallelism (tp, an ExpertShard) gate_up's B keeps this rank's gate and
    up rows and down's A its columns."""
    if tp is None:
        return [sa, sb], [a, b]
    if i == 0:
        half = sb.shape[1] // 2
        gate, up = tp.gate_up(1).views(b)
        return [sa, sb[:, :half], sb[:, half:]], [a, gate, up]
    return [sa, sb], [tp.down(2).views(a)[0], b]


# Off: one copy_ per tensor (kept to measure against, benchmarks/slot_load.py).
BATCHED_COPIES = True
MAX_LAYOUTS = 64  # file layouts whose staging views are kept (each ~1 KB per tensor)


class Staging:
    """Copies adapters into slots from pinned memory, asynchronously on the current stream.

    An adapter's tensors live in one pinned buffer (its file, read whole, or the buffer
    they were converted into), so on a GPU the span holding them goes over in one
    host-to-device copy into a device buffer kept for this, and one batched device copy
    (torch._foreach_copy_) places them in their slots, after one batched multiply per
    distinct scaling: three calls instead of one per tensor (448 for Llama-8B on all
    seven projections, each ~10-15 us of the engine thread's time and one small DMA).
    The views of the device buffer are kept per file layout (adapters trained with one
    config share it), so a load makes no tensor views either."""

    def __init__(self):
        self.buffer: torch.Tensor | None = None
        self._views: dict[tuple, list[torch.Tensor]] = {}

    def copy(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], scales: list[float]) -> None:
        """dsts[i].copy_(srcs[i] * scales[i])."""
        if not dsts:
            return
        if not BATCHED_COPIES or dsts[0].device.type != "cuda" or not _one_pinned_buffer(srcs):
            for d, s, scale in zip(dsts, srcs, scales):
                d.copy_(s, non_blocking=True)
                if scale != 1.0:
                    d.mul_(scale)
            return
        storage = srcs[0].untyped_storage()
        base = storage.data_ptr()
        buffer = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),))
        # Views of it, strided where a tensor-parallel rank takes some columns of A.
        spans = [(s.data_ptr() - base, tuple(s.shape), None if s.is_contiguous() else tuple(s.stride()))
                 for s in srcs]
        self._staged(dsts, buffer, spans, srcs[0].dtype, scales)

    def copy_from_file(self, dsts: list[torch.Tensor], file: Mapping[str, torch.Tensor], names: list[str],
                       scales: list[float]) -> None:
        """copy() from the tensors `names` of `file`: for a TensorFile the byte offsets
        come from its header (no tensor view is made). From pageable memory (a load that
        found the pinned pool spent) the one host-to-device copy is synchronous."""
        entries = [file.entries[n] for n in names] if isinstance(file, TensorFile) else None
        if (not BATCHED_COPIES or not dsts or dsts[0].device.type != "cuda" or entries is None
                or any(e.dtype != dsts[0].dtype or e.begin % e.dtype.itemsize for e in entries)):
            self.copy(dsts, [file[n] for n in names], scales)
            return
        spans = [(e.begin, e.shape, None) for e in entries]
        self._staged(dsts, file.buffer, spans, entries[0].dtype, scales)

    def _staged(self, dsts: list[torch.Tensor], buffer: torch.Tensor, spans: list[tuple],
                dtype: torch.dtype, scales: list[float]) -> None:
        """spans[i] = (byte offset in `buffer`, shape, stride or None if contiguous)."""
        item = dtype.itemsize
        lo = min(off for off, _, _ in spans)
        hi = max(off + _extent(shape, stride) * item for off, shape, stride in spans)
        dev = dsts[0].device
        if self.buffer is None or self.buffer.numel() < hi - lo or self.buffer.device != dev:
            # Steps after this one read it in stream order: a new buffer only when it grows.
            self.buffer = torch.empty(hi - lo, dtype=torch.uint8, device=dev)
            self._views = {}
        self.buffer[: hi - lo].copy_(buffer[lo:hi], non_blocking=True)
        key = (dtype, tuple((off - lo, shape, stride) for off, shape, stride in spans))
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= MAX_LAYOUTS:  # adapters of many shapes: forget the oldest
                del self._views[next(iter(self._views))]
            typed = self.buffer.view(dtype)
            views = self._views[key] = [
                typed.as_strided(shape, stride or _contiguous(shape), (off - lo) // item)
                for off, shape, stride in spans]
        by_scale: dict[float, list[torch.Tensor]] = {}
        for view, scale in zip(views, scales):
            if scale != 1.0:
                by_scale.setdefault(scale, []).append(view)
        for scale, group in by_scale.items():
            torch._foreach_mul_(group, scale)
        torch._foreach_copy_(dsts, views)


def _extent(shape: tuple[int, ...], stride: tuple[int, ...] | None) -> int:
    """Elements from a view's first to one past its last (its span in the buffer)."""
    if stride is None:
        return math.prod(shape)
    return 1 + sum((n - 1) * st for n, st in zip(shape, stride)) if all(shape) else 0


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, n = [], 1
    for d in reversed(shape):
        strides.append(n)
        n *= d
    return tuple(reversed(strides))


def _one_pinned_buffer(srcs: list[torch.Tensor]) -> bool:
    first = srcs[0].untyped_storage()
    base, dtype = first.data_ptr(), srcs[0].dtype
    return srcs[0].device.type == "cpu" and srcs[0].is_pinned() and all(
        s.dtype == dtype and s.untyped_storage().data_ptr() == base
        and (s.data_ptr() - base) % dtype.itemsize == 0 for s in srcs)

