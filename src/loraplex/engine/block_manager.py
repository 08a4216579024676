"""KV cache pages: a free list, reference counts, and the prefix cache. Pure Python.

The KV cache is `num_blocks` pages of `block_size` token slots each. A request owns an
ordered list of pages (its block table); token at position p lives in slot
`block_ids[p // block_size] * block_size + p % block_size`. Reference counts let pages
be shared: a page returns to the pool when its last owner lets go.

Prefix caching: a full page whose keys and values are computed is registered under its
hash, a digest of (the previous page's hash, its tokens, the extra key: the adapter's
content id and any salt), so a page stands for a whole prefix computed under one
adapter. A request admitted later takes the longest run of its pages' hashes that is
registered instead of computing them. A registered page whose last owner lets go stays
registered, in least-recently-used order, until the pool needs it: pages are taken
from the plain free list first, then from the oldest cached ones.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque


def page_hashes(tokens: list[int], block_size: int, extra: str, parent: bytes = b"",
                start: int = 0) -> list[bytes]:
    """The hashes of the full pages of `tokens` from page `start` on, chained from
    `parent` (the hash of page start - 1, or b"" for the first page)."""
    out = []
    for i in range(start, len(tokens) // block_size):
        key = extra.encode()
        h = hashlib.blake2b(parent + len(key).to_bytes(4, "little") + key, digest_size=16)
        h.update(",".join(map(str, tokens[i * block_size : (i + 1) * block_size])).encode())
        parent = h.digest()
        out.append(parent)
    return out


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False):
        assert num_blocks > 0 and block_size > 0, (num_blocks, block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_count = [0] * num_blocks
        self._page_of: dict[bytes, int] = {}  # registered hash -> page
        self._hash_of: dict[int, bytes] = {}  # registered page -> hash
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered, unowned; oldest first
        self.num_queried_tokens = 0  # prefix-cache lookups, in tokens
        self.num_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        """Pages a request can get: free, or cached and unowned (evicted for it)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._page_of)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, block_ids: list[int], num_tokens: int) -> int:
        """Pages a block table of `block_ids` must gain to hold `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(block_ids))

    def can_grow(self, block_ids: list[int], num_tokens: int, reserved: int = 0) -> bool:
        """Whether `block_ids` can grow to `num_tokens` tokens when `reserved` of the
        pages counted free will be taken first (cache hits on unowned pages)."""
        return self.num_new_blocks(block_ids, num_tokens) <= self.num_free_blocks - reserved

    def grow(self, block_ids: list[int], num_tokens: int) -> None:
        """Append pages to `block_ids` (in place) until it holds `num_tokens` tokens."""
        n = self.num_new_blocks(block_ids, num_tokens)
        assert n <= self.num_free_blocks, f"need {n} pages, {self.num_free_blocks} free"
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:  # the least recently used cached page leaves the cache
                block, _ = self._evictable.popitem(last=False)
                del self._page_of[self._hash_of.pop(block)]
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
        """Drop one reference on each page (in place: `block_ids` ends empty). A cached
        page stays cached; the last pages of a table are the first to be evicted."""
        for b in reversed(block_ids):
            assert self._ref_count[b] > 0, f"double free of page {b}"
            self._ref_count[b] -= 1
            if self._ref_count[b] == 0:
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)
        block_ids.clear()

    # -- prefix cache --------------------------------------------------------------------

    def cached_prefix(self, hashes: list[bytes]) -> list[int]:
        """The pages of the longest leading run of `hashes` that is registered (counted
        in the hit statistics by the caller's take())."""
        pages = []
        for h in hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def num_unowned(self, pages: list[int]) -> int:
        return sum(1 for p in pages if self._ref_count[p] == 0)

    def take(self, pages: list[int], queried_tokens: int) -> list[int]:
        """Reference cache hits `pages` (from cached_prefix) for a new owner; returns its
        block table's start."""
        self.num_queried_tokens += queried_tokens
        self.num_hit_tokens += len(pages) * self.block_size
        for p in pages:
            if self._ref_count[p] == 0:
                del self._evictable[p]
            self._ref_count[p] += 1
        return list(pages)

    def forget_cache(self) -> None:
        """Unregister every page (after a failed step, whose pages may be half written)."""
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._page_of.clear()
        self._hash_of.clear()

    def register(self, page: int, h: bytes) -> None:
        """Page `page` (owned, full, computed) holds the prefix hashed `h`. A prefix
        already registered keeps its first page (two requests computed it at once)."""
        if self.enable_caching and h not in self._page_of and page not in self._hash_of:
            self._page_of[h] = page
            self._hash_of[page] = h
