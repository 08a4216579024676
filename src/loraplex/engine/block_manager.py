"""KV cache pages: a free list and reference counts. Pure Python, no tensors.

The KV cache is `num_blocks` pages of `block_size` token slots each. A request owns an
ordered list of pages (its block table); token at position p lives in slot
`block_ids[p // block_size] * block_size + p % block_size`. Reference counts let pages
be shared (prefix reuse, forks): a page returns to the free list when its last owner
lets go.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        assert num_blocks > 0 and block_size > 0, (num_blocks, block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_count = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, block_ids: list[int], num_tokens: int) -> int:
        """Pages a block table of `block_ids` must gain to hold `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(block_ids))

    def can_grow(self, block_ids: list[int], num_tokens: int) -> bool:
        return self.num_new_blocks(block_ids, num_tokens) <= len(self._free)

    def grow(self, block_ids: list[int], num_tokens: int) -> None:
        """Append pages to `block_ids` (in place) until it holds `num_tokens` tokens."""
        n = self.num_new_blocks(block_ids, num_tokens)
        assert n <= len(self._free), f"need {n} pages, {len(self._free)} free"
        for _ in range(n):
            block = self._free.popleft()
            assert self._ref_count[block] == 0, f"free page {block} still referenced"
            self._ref_count[block] = 1
            block_ids.append(block)

    def share(self, block_ids: list[int]) -> list[int]:
        """Take another reference on every page of `block_ids` and return a copy."""
        for b in block_ids:
            assert self._ref_count[b] > 0, f"sharing unowned page {b}"
            self._ref_count[b] += 1
        return list(block_ids)

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference on each page (in place: `block_ids` ends empty)."""
        for b in reversed(block_ids):
            assert self._ref_count[b] > 0, f"double free of page {b}"
            self._ref_count[b] -= 1
            if self._ref_count[b] == 0:
                self._free.append(b)
        block_ids.clear()
