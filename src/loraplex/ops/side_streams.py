"""Work launched on a side stream, beside the main stream's: a LoRA shrink beside its
base GEMM, the MoE gate/up adapter delta beside the expert alignment and the down delta
beside the down GEMM, DeepSeek's shared experts beside the routed ones. `beside` forks
(the side stream first waits on the current one, so memory either frees is never reused
early), `join` makes the current stream wait for the side work before its results are
read.

Kernels launched there go without programmatic dependent launch (ops/triton/launch.py):
in gpt-oss-20b MXFP4's decode graph with 16 adapters (H200), PDL on the side stream's
launches cost 0.18 ms a step (7.22 ms without it there, 7.40 with; the main stream's
launches keep it). Qwen3-30B-A3B W8A8's was the same either way (9.18 / 9.20 ms).
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager

import torch

_ON_SIDE = contextvars.ContextVar("loraplex_on_side_stream", default=False)


@contextmanager
def on_side_stream(stream: torch.cuda.Stream | None):
    """torch.cuda.stream(stream), with the kernels launched inside marked as side work
    (stream None: no stream change, as torch.cuda.stream(None))."""
    token = _ON_SIDE.set(True)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        _ON_SIDE.reset(token)


@contextmanager
def beside(stream: torch.cuda.Stream | None):
    """Launches inside go to `stream`, after the current stream's work so far, marked as
    side work (on_side_stream); stream None: they stay on the current stream, in order."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream())
    with on_side_stream(stream):
        yield


def join(stream: torch.cuda.Stream | None) -> None:
    """The current stream waits for the work launched on `stream` (beside); None: nothing."""
    if stream is not None:
        torch.cuda.current_stream().wait_stream(stream)


def launching_on_side() -> bool:
    """Whether kernels launched now go to a side stream (inside on_side_stream)."""
    return _ON_SIDE.get()
