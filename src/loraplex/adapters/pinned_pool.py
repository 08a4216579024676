"""Page-locked host buffers for adapters, allocated once and reused ("host slots").

Page-locking memory (cudaHostAlloc) is slow and takes a driver lock that stalls the
engine's kernel launches (a 128 MiB allocation on a loader thread was seen holding it
for ~240 ms under load), so the host tier does not allocate per load: it owns one
buffer per host-memory adapter plus one per loader thread, each big enough for the
largest adapter the model allows (every projection at max_lora_rank), carved out of one
region page-locked at startup (cudaHostRegister: PyTorch's pinned allocator would round
each buffer, or the region, up to a power of two). A buffer comes back when its adapter
leaves host memory, and is handed out again only after the last GPU copy from it has
finished (an event recorded by the runner). An adapter that finds the pool empty (more
referenced adapters than host slots, or more host slots than MAX_BYTES holds) or too
small (a float32 file) is read into pageable memory (never page-locked while serving).
"""

from __future__ import annotations

import logging
import threading

import torch

logger = logging.getLogger("loraplex")

# Page-locked memory reserved at startup unless the host tier has a byte budget.
DEFAULT_MAX_BYTES = 4 << 30
_ALIGN = 4096


class PinnedPool:
    def __init__(self, count: int, nbytes: int, max_bytes: int | None = None, pinned: bool = True):
        self.nbytes = nbytes
        stride = -(-nbytes // _ALIGN) * _ALIGN
        count = max(1, min(count, (max_bytes or DEFAULT_MAX_BYTES) // stride))
        self._locked = _PageLocked(count * stride) if pinned else None
        self.region = self._locked.tensor if pinned else _aligned(count * stride)
        # Whole pages each (page-aligned: O_DIRECT reads can land in them).
        self._free: list[tuple[torch.Tensor, torch.cuda.Event | None]] = [
            (self.region[i * stride : (i + 1) * stride], None) for i in range(count)]
        self._lock = threading.Lock()
        self.misses = 0  # takes that found no buffer (the load then reads into pageable memory)

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A buffer of >= nbytes (None if the pool is spent or nbytes is too big: the
        caller allocates its own). Any thread; may wait for a copy still reading it."""
        if nbytes > self.nbytes:
            return None
        with self._lock:
            if not self._free:
                self.misses += 1
                return None
            buf, event = self._free.pop()
        if event is not None:
            event.synchronize()
        return buf

    def give(self, buf: torch.Tensor, event: torch.cuda.Event | None) -> None:
        with self._lock:
            self._free.append((buf, event))


def _aligned(nbytes: int) -> torch.Tensor:
    raw = torch.empty(nbytes + _ALIGN, dtype=torch.uint8)
    return raw[-raw.data_ptr() % _ALIGN :][:nbytes]


class _PageLocked:
    """nbytes of page-locked memory, locked as they are (no rounding up); unlocked when
    the pool goes (a buffer still in use after that is copied from as pageable memory)."""

    def __init__(self, nbytes: int):
        self.tensor = _aligned(nbytes)
        # The whole allocation, from its start: torch asks whether a view is page-locked
        # by its storage's first byte, which lies before the aligned start.
        storage = self.tensor.untyped_storage()
        self._base = storage.data_ptr()
        self.registered = int(torch.cuda.cudart().cudaHostRegister(self._base, storage.nbytes(), 0)) == 0
        if not self.registered:  # e.g. a locked-memory limit: PyTorch's allocator, rounded up
            logger.warning("cudaHostRegister of %.1f GiB failed; using PyTorch's pinned allocator",
                           nbytes / 2**30)
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def __del__(self):
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self._base)
