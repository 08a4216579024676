"""What the LoRA kernels share: where the GEMV form ends, slice offsets and the alignment
hints that let them move whole 16-byte vectors.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# Up to this many tokens a step runs the GEMV (per-token, or per (token, expert) pair on
# experts) LoRA kernels, above it the segmented / aligned GEMMs: decode batches are at
# most this large per CUDA graph bucket.
GEMV_MAX_TOKENS = 64


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


def gated_output(gate_up: torch.Tensor, buf: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
    """The output [T, I] of an activation fused with the gate/up expand (both forms), once
    the operands are checked: gate_up [T, 2I], buf [2, T, R] and B [L, 2I, R], each with
    unit stride along its last dimension."""
    num_tokens, two_width = gate_up.shape
    assert buf.shape[:2] == (2, num_tokens) and lora_b.shape[1] == two_width, (buf.shape, lora_b.shape)
    assert gate_up.stride(1) == 1 and buf.stride(2) == 1 and lora_b.stride(2) == 1
    return torch.empty(num_tokens, two_width // 2, dtype=gate_up.dtype, device=gate_up.device)


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
