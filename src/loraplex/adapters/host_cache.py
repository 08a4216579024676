"""Adapters in (page-locked) host memory, keyed by content id, least recently used out.

A request holds a reference on its adapter from the moment the adapter is in memory
until the request ends; a referenced or pinned adapter is never dropped, so the runner
can always copy it into a GPU slot. Capacity is a count (vLLM's max_cpu_loras) and
optionally a byte budget.
"""

from __future__ import annotations

from collections import OrderedDict

from loraplex.adapters.peft import LoRAAdapter


class HostCache:
    def __init__(self, capacity: int, max_bytes: int | None = None, on_drop=None):
        self.capacity = capacity
        self.on_drop = on_drop or (lambda adapter: None)  # called with each dropped adapter
        self.max_bytes = max_bytes
        self._adapters: OrderedDict[str, LoRAAdapter] = OrderedDict()  # LRU first
        self._refs: dict[str, int] = {}
        self.pinned: set[str] = set()
        self.nbytes = 0
        self.num_evictions = 0

    def __contains__(self, key: str) -> bool:
        return key in self._adapters

    def __len__(self) -> int:
        return len(self._adapters)

    def get(self, key: str) -> LoRAAdapter:
        assert key in self._adapters, f"adapter {key} is not in host memory"
        return self._adapters[key]

    def put(self, adapter: LoRAAdapter, refs: int = 0) -> None:
        """Insert (or keep the copy already there: content ids name identical bytes) and
        take `refs` references. Referenced adapters may hold the cache over capacity."""
        if adapter.key not in self._adapters:
            self._adapters[adapter.key] = adapter
            self.nbytes += adapter.nbytes
        else:
            self.on_drop(adapter)  # a second copy of content already here
        for _ in range(refs):
            self.ref(adapter.key)
        self._evict()

    def ref(self, key: str) -> None:
        self._adapters.move_to_end(key)
        self._refs[key] = self._refs.get(key, 0) + 1

    def unref(self, key: str) -> None:
        self._refs[key] -= 1
        if not self._refs[key]:
            del self._refs[key]
        self._evict()

    def forget(self, key: str) -> None:
        """Drop `key` now if nothing holds it (an unloaded adapter)."""
        if key not in self._refs and key not in self.pinned and key in self._adapters:
            self._drop(key)

    def _drop(self, key: str) -> None:
        adapter = self._adapters.pop(key)
        self.nbytes -= adapter.nbytes
        self.on_drop(adapter)

    def _over(self) -> bool:
        return len(self._adapters) > self.capacity or (
            self.max_bytes is not None and self.nbytes > self.max_bytes)

    def _evict(self) -> None:
        if not self._over():
            return
        for key in [k for k in self._adapters if k not in self._refs and k not in self.pinned]:
            self._drop(key)
            self.num_evictions += 1
            if not self._over():
                break
