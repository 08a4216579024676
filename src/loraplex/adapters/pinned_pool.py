"""Page-locked host buffers for adapters, allocated once and reused ("host slots").

Page-locking memory (cudaHostAlloc) is slow and takes a driver lock that stalls the
engine's kernel launches, so the host tier does not allocate per load: it owns one
buffer per host-memory adapter (plus one per loader thread), each big enough for the
largest adapter the model allows (every projection at max_lora_rank), all allocated at
startup. A buffer comes back when its adapter leaves host memory, and is handed out
again only after the last GPU copy from it has finished (an event recorded by the
runner). An adapter that finds the pool empty (more referenced adapters than host
slots, or more host slots than MAX_BYTES holds) or too small (a float32 file) allocates
its own.
"""

from __future__ import annotations

import threading

import torch

# Page-locked memory reserved at startup unless the host tier has a byte budget. Buffers
# are sized for max_lora_rank and torch rounds page-locked allocations up to a power of
# two, so a large max_lora_rank x max_cpu_loras would otherwise lock tens of GiB up front.
DEFAULT_MAX_BYTES = 4 << 30


class PinnedPool:
    def __init__(self, count: int, nbytes: int, max_bytes: int | None = None, pinned: bool = True):
        self.nbytes = nbytes
        budget = max_bytes or DEFAULT_MAX_BYTES
        count = max(1, min(count, budget // (1 << (nbytes - 1).bit_length())))
        self._free: list[tuple[torch.Tensor, torch.cuda.Event | None]] = [
            (torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned), None) for _ in range(count)]
        self._lock = threading.Lock()
        self.misses = 0  # takes that found no buffer (the load then page-locks its own)

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
