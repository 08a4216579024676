"""What the LoRA kernels share: where the GEMV form ends, the tiles a segmented launch
covers, slice offsets and the alignment hints that let them move whole 16-byte vectors.

Tiles: which (adapter group, token block) pairs a segmented (SGMV) launch covers.

In an eager step the token groups are known on the host, so a launch covers exactly the
tiles that hold tokens: prefill of 8192 tokens over 32 adapters launches 32 x 256 / 64
tiles, not 32 x 8192 / 64 mostly empty ones. A CUDA graph is captured once for every
future batch, so there the grid covers every group x every token block and tiles
without tokens exit at once (with BLOCK_M >= the batch size that is one tile a group).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from loraplex.device import to_device
from loraplex.ops.metadata import LoRABatch

# Up to this many tokens a step runs the GEMV (per-token, or per (token, expert) pair on
# experts) LoRA kernels, above it the segmented / aligned GEMMs: decode batches are at
# most this large per CUDA graph bucket.
GEMV_MAX_TOKENS = 64


def lora_tiles(batch: LoRABatch, num_tokens: int, block_m: int) -> tuple[torch.Tensor | None, int]:
    """Tiles of up to `block_m` rows. Returns (tiles, n): tiles is int32 [2, n] of
    (group, first sorted position), or None when the grid is static: tile i is group
    i // blocks, block i % blocks."""
    if not batch.groups:  # graph capture: groups are only known on the device
        return None, batch.group_slots.shape[0] * triton.cdiv(num_tokens, block_m)
    key = ("tiles", block_m)
    if key not in batch.cache:
        groups, starts = [], []
        for i, g in enumerate(batch.groups):
            for m0 in range(g.start, g.end, block_m):
                groups.append(i)
                starts.append(m0)
        batch.cache[key] = to_device([groups, starts], torch.int32, batch.group_slots.device)
    tiles = batch.cache[key]
    return tiles, tiles.shape[1]


_slice_starts: dict[tuple, torch.Tensor] = {}


def slice_starts(sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """int32 [S + 1] column offsets of a fused projection's slices. Cached: the first
    (eager) call creates it, so CUDA graph replays read a stable tensor."""
    key = (sizes, str(device))
    if key not in _slice_starts:
        starts = [0]
        for n in sizes:
            starts.append(starts[-1] + n)
        _slice_starts[key] = torch.tensor(starts, dtype=torch.int32, device=device)
    return _slice_starts[key]


@triton.jit
def rank_ceil(rank):
    """`rank` rounded up to 8 (one 16-byte bf16 vector), marked as such for the compiler.
    Reading B up to it
    instead of `rank` keeps the loads vectorized and adds only zeros: slots keep B's
    columns past the adapter's rank at zero."""
    return tl.multiple_of((rank + 7) // 8 * 8, 8)


def column_alignment(sizes: tuple[int, ...]) -> int:
    """The largest power of two up to 16 dividing every slice offset: the hint that tells a
    kernel its slice boundaries (loaded from memory) fall on whole vectors."""
    g = 0
    for n in sizes:
        g = math.gcd(g, n)
    return math.gcd(g, 16) or 1
