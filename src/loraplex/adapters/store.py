"""Adapters in host memory: loaded and validated on first use, dropped least recently used.

The engine takes a reference on a request's adapter when the request arrives and lets go
when it ends; an adapter with references is never dropped, so the runner can always
copy it into a GPU slot by key.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping

from loraplex.adapters.peft import LoRAAdapter, load_peft_adapter
from loraplex.types import LoRARequest


class AdapterStore:
    def __init__(self, projections: Mapping[str, tuple[int, int]], max_rank: int, capacity: int):
        self.projections = projections  # module path -> (in_features, out_features)
        self.max_rank = max_rank
        self.capacity = capacity
        self._adapters: OrderedDict[str, LoRAAdapter] = OrderedDict()  # LRU first
        self._refs: dict[str, int] = {}
        self.num_loads = 0  # adapters read from disk
        self.num_evictions = 0  # adapters dropped from host memory

    def __contains__(self, key: str) -> bool:
        return key in self._adapters

    def acquire(self, lora: LoRARequest) -> float | None:
        """Load (or find) `lora` and hold it in memory until release(). Returns the
        seconds spent reading it from disk (None: it was in memory). Raises AdapterError."""
        load_time = None
        if lora.key not in self._adapters:  # as in vLLM, a known key is not reloaded
            t0 = time.perf_counter()
            self._adapters[lora.key] = load_peft_adapter(
                lora.key, lora.lora_name, lora.lora_path, self.projections, self.max_rank
            )
            load_time = time.perf_counter() - t0
            self.num_loads += 1
        self._adapters.move_to_end(lora.key)
        self._refs[lora.key] = self._refs.get(lora.key, 0) + 1
        self._evict()
        return load_time

    def forget(self, key: str) -> None:
        """Drop `key` from memory once no request holds it (an unloaded adapter)."""
        if key not in self._refs:
            self._adapters.pop(key, None)

    def release(self, key: str) -> None:
        self._refs[key] -= 1
        if not self._refs[key]:
            del self._refs[key]
        self._evict()

    def get(self, key: str) -> LoRAAdapter:
        assert key in self._adapters, f"adapter {key} is not in host memory"
        return self._adapters[key]

    def _evict(self) -> None:
        idle = [k for k in self._adapters if k not in self._refs]
        while len(self._adapters) > self.capacity and idle:
            del self._adapters[idle.pop(0)]
            self.num_evictions += 1
