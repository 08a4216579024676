"""Tiles of a segmented row range, found on the device.

Segmented kernels (LoRA SGMV over adapter groups, prefill attention over sequences) cut
each segment s, rows [starts[s], starts[s + 1]), into tiles of BLOCK rows, numbered
segment after segment. A program finds its tile's segment from `starts` itself instead
of a host-built tile table, so its launch depends only on an upper bound of the tile
count: `max_tiles(rows, segments, BLOCK)`. That makes one launch (and one CUDA graph
captured around it) serve any split of the rows into segments; programs past the last
tile exit at once.
"""

from __future__ import annotations

import triton
import triton.language as tl

CHUNK = tl.constexpr(64)  # segments scanned per loop trip


def max_tiles(num_rows: int, num_segments: int, block: int) -> int:
    """Tiles any split of num_rows rows into num_segments segments can need: each segment
    adds at most one partial tile."""
    return triton.cdiv(num_rows, block) + num_segments


@triton.jit
def _segment_of_tile(tile, starts_ptr, num_segments, BLOCK: tl.constexpr):
    """(segment of tile number `tile`, tiles in the segments before it): a prefix sum over
    the segments' tile counts, CHUNK segments per trip. Past the last tile: (num_segments,
    every segment's tiles)."""
    seg = 0
    tiles_before = 0
    total = 0
    for c0 in range(0, num_segments, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        mask = offs < num_segments
        lo = tl.load(starts_ptr + offs, mask=mask, other=0)
        hi = tl.load(starts_ptr + offs + 1, mask=mask, other=0)
        n = tl.where(mask, (hi - lo + BLOCK - 1) // BLOCK, 0)
        ends = total + tl.cumsum(n, 0)  # tile number one past each segment's last
        before = mask & (ends <= tile)  # a prefix: the segments wholly before `tile`
        seg += tl.sum(before.to(tl.int32), 0)
        tiles_before += tl.sum(tl.where(before, n, 0), 0)
        total += tl.sum(n, 0)
    return seg, tiles_before


@triton.jit
def find_tile(tile, starts_ptr, num_segments, BLOCK: tl.constexpr):
    """(segment, first row) of tile number `tile`; segment == num_segments past the last
    tile."""
    seg, tiles_before = _segment_of_tile(tile, starts_ptr, num_segments, BLOCK)
    first_row = 0
    if seg < num_segments:
        first_row = tl.load(starts_ptr + seg) + (tile - tiles_before) * BLOCK
    return seg, first_row


@triton.jit
def find_tile_or_tail(tile, starts_ptr, num_segments, num_rows, BLOCK: tl.constexpr):
    """find_tile over the segments and then one more, the tail: rows [starts[num_segments],
    num_rows) (LoRA groups, then the tokens without an adapter). (segment, first row);
    segment == num_segments for the tail's tiles, num_segments + 1 past the last tile.
    Launch max_tiles(num_rows, num_segments + 1, BLOCK) programs."""
    seg, tiles_before = _segment_of_tile(tile, starts_ptr, num_segments, BLOCK)
    first_row = tl.load(starts_ptr + seg) + (tile - tiles_before) * BLOCK
    if seg == num_segments and first_row >= num_rows:
        seg = num_segments + 1
    return seg, first_row
