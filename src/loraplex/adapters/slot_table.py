"""Which adapter sits in which GPU slot: the scheduler's view, pure Python.

A slot holds at most one adapter. Running requests hold references on their adapter's
slot; a referenced slot is never reassigned. Unreferenced occupied slots stay loaded (a
later request for the same adapter needs no copy) and are reused least recently used
first, after the empty ones.
"""

from __future__ import annotations

from collections import OrderedDict


class SlotTable:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._key_in: list[str | None] = [None] * num_slots
        self._slot_of: dict[str, int] = {}
        self._refs = [0] * num_slots
        self._idle: OrderedDict[int, None] = OrderedDict()  # occupied, unreferenced; LRU first
        self.num_loads = 0  # adapters copied into a slot
        self.num_evictions = 0  # resident adapters replaced by another

    def slot_of(self, key: str) -> int | None:
        return self._slot_of.get(key)

    def key_in(self, slot: int) -> str | None:
        return self._key_in[slot]

    def refs(self, slot: int) -> int:
        return self._refs[slot]

    def can_acquire(self, key: str) -> bool:
        return key in self._slot_of or self._free_slot() is not None

    def acquire(self, key: str) -> tuple[int, bool]:
        """Reference `key`'s slot, assigning one if needed. Returns (slot, must_load)."""
        slot = self._slot_of.get(key)
        must_load = slot is None
        if slot is None:
            slot = self._free_slot()
            assert slot is not None, "acquire() without a free slot; check can_acquire()"
            old = self._key_in[slot]
            if old is not None:
                del self._slot_of[old]
                self.num_evictions += 1
            self.num_loads += 1
            self._key_in[slot] = key
            self._slot_of[key] = slot
        self._idle.pop(slot, None)
        self._refs[slot] += 1
        return slot, must_load

    def release(self, slot: int) -> None:
        assert self._refs[slot] > 0, f"release of unreferenced slot {slot}"
        self._refs[slot] -= 1
        if self._refs[slot] == 0:
            self._idle[slot] = None

    def forget(self, key: str) -> bool:
        """Drop `key` from its slot if no request uses it; False if it is in use."""
        slot = self._slot_of.get(key)
        if slot is None:
            return True
        if self._refs[slot]:
            return False
        del self._slot_of[key]
        self._key_in[slot] = None
        self._idle.pop(slot, None)
        return True

    def _free_slot(self) -> int | None:
        for slot, key in enumerate(self._key_in):
            if key is None:
                return slot
        return next(iter(self._idle), None)
