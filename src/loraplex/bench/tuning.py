"""What the kernel tuners share (bench/tune_moe.py, bench/tune_fp8.py): the shared-memory
budget a config's pipeline must fit, and the timer."""

from __future__ import annotations

import statistics

import torch

SMEM_BYTES = 200 * 1024  # H100 / H200 allow 227 KiB per block; leave room for the epilogue


def time_ms(fn, repeats: int = 20, inner: int = 10) -> float:
    """Median over `repeats` of the mean time of `inner` back-to-back calls."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)
