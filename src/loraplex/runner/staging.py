"""A step's small input tensors packed back to back in one arena, copied to the device
in one copy.

Each host-to-device copy costs the host ~10-20 us to issue (more with the views it
slices), and a decode step of a small model is bound by its host: thirteen copies a
step were a fifth of Gemma 3 270M's step. So a step writes its tensors into a pinned
host arena at offsets given by a `Layout` and copies the arena's used bytes once; ops
read typed views of the device arena at the same offsets.

A layout is a function of the step's sizes only (tokens, sequences, adapters or not), so
a CUDA graph captured on a layout's views reads the same addresses whenever a step of
its shape is staged again. After the layout's fields, `tail` places fields no graph
reads (sampled rows, the speculation index), sized per step.

The host arena has two twins used in turn: a step's copy may not have run when the host
fills the next step's inputs (it queues behind the step's adapter slot copies,
milliseconds for a large adapter), and with one step in flight the twin a step writes
was last read by the step before the previous one, whose results the engine has
already collected. On a CPU the arena is the tensor ops read: one, and no copies.
"""

from __future__ import annotations

import numpy as np
import torch

ALIGN = 16  # bytes: each field starts on a multiple


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Layout:
    """Fields at fixed offsets: `np[twin][name]` the host views (numpy), `dev[name]` the
    device views, `end` the bytes they span."""

    def __init__(self, arena: StagingArena, fields: list[tuple[str, torch.dtype, int]]):
        self.offsets, offset = {}, 0
        for name, dtype, count in fields:
            self.offsets[name] = (offset, dtype, count)
            offset = _aligned(offset + count * dtype.itemsize)
        self.end = offset
        assert self.end <= arena.nbytes, (self.end, arena.nbytes)
        self.dev = {name: arena.dev_view(o, dt, n) for name, (o, dt, n) in self.offsets.items()}
        self.np = [{name: arena.host_view(twin, o, dt, n) for name, (o, dt, n) in self.offsets.items()}
                   for twin in range(len(arena.hosts))]


class StagingArena:
    def __init__(self, nbytes: int, device: torch.device):
        self.nbytes = nbytes
        if device.type == "cpu":
            self.hosts = [torch.zeros(nbytes, dtype=torch.uint8)]
            self.dev = self.hosts[0]
        else:
            self.hosts = [torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            self.dev = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self._nps = [h.numpy() for h in self.hosts]
        self.turn = 0
        self._layouts: dict[tuple, Layout] = {}

    def layout(self, key: tuple, fields) -> Layout:
        """The layout of `fields` [(name, dtype, count)], cached by `key` (which must
        determine them); its offsets depend on the fields only."""
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) >= 256:  # eager steps' sizes vary: keep the cache small
                self._layouts.clear()
            layout = self._layouts[key] = Layout(self, fields())
        return layout

    def next_turn(self) -> None:
        """Write the other host twin from now on (called once per step)."""
        self.turn = (self.turn + 1) % len(self.hosts)

    def tail(self, start: int, values: list[int],
             dtype: torch.dtype = torch.int64) -> tuple[int, torch.Tensor]:
        """Write `values` at the first aligned offset from `start`, in this turn's twin;
        returns (the offset after them, their device view)."""
        offset = _aligned(start)
        n = len(values)
        assert offset + n * dtype.itemsize <= self.nbytes
        self.host_view(self.turn, offset, dtype, n)[:] = values
        return offset + n * dtype.itemsize, self.dev_view(offset, dtype, n)

    def upload(self, nbytes: int) -> None:
        """Copy this turn's first `nbytes` to the device."""
        if self.dev is not self.hosts[0]:
            self.dev[:nbytes].copy_(self.hosts[self.turn][:nbytes], non_blocking=True)

    def host_view(self, twin: int, offset: int, dtype: torch.dtype, count: int) -> np.ndarray:
        return self._nps[twin][offset: offset + count * dtype.itemsize].view(_NUMPY[dtype])

    def dev_view(self, offset: int, dtype: torch.dtype, count: int) -> torch.Tensor:
        return self.dev[offset: offset + count * dtype.itemsize].view(dtype)


_NUMPY = {torch.int32: np.int32, torch.int64: np.int64}
