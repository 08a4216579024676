"""Programmatic dependent launch (PDL, sm_90 on) for the engine's Triton kernels.

In the CUDA graph of a decode step some 15 small kernels a layer follow one another, and
each one's launch waited for the one before to drain: ~1.6 us a kernel on an H200 for a
kernel with almost no work (`rms_norm`; benchmarks/pdl_probe.py, 1.2 us with PDL).
Launched with PDL, a kernel's programs may be scheduled while the grid before it still
runs. Every kernel therefore starts with `wait_for_inputs`: it waits until the grids
before it have finished and their writes are visible, then lets the next kernel launch.
What overlaps is the launch and the ramp, never a read of an input. Kernels before and
after that are not ours (cuBLAS, torch) keep ordinary stream order, and so do ours when
launched on a side stream (ops/side_streams.py says why).

Off under the interpreter, on GPUs before sm_90 and with LORAPLEX_PDL=0 (to compare; any
other value than 0 or 1 is refused at startup).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from loraplex.ops.side_streams import launching_on_side
from loraplex.ops.triton.precision import INTERPRETED


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """First in every kernel: with PDL, wait for the grids this launch depends on (their
    writes visible), then let the kernel after this one launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def _setting() -> str:
    setting = os.environ.get("LORAPLEX_PDL", "1")
    if setting not in ("0", "1"):
        raise ValueError(f"LORAPLEX_PDL must be 0 or 1, got {setting!r}")
    return setting


_setting()  # a bad value fails where the engine imports its kernels: at startup


@functools.cache
def _enabled() -> bool:
    if INTERPRETED or _setting() == "0" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability() >= (9, 0)


def pdl() -> dict:
    """The launch arguments of a kernel that starts with wait_for_inputs: its PDL
    constexpr and Triton's launch_pdl option, both on where PDL is, off on a side stream."""
    on = _enabled() and not launching_on_side()
    return dict(PDL=on, launch_pdl=on)
