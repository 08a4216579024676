"""Where a timed in-process run's time went: engine steps by kind (host time, device time,
slot copies), page-locked allocations, and Triton kernels compiled while timed. The
engine thread's Python stacks are sampled by stack_sampler.py."""

from __future__ import annotations

import traceback
from contextlib import contextmanager
from pathlib import Path

from loraplex.runner.step_outputs import StepTiming


@contextmanager
def compiled_kernels():
    """Yields a list that collects the Triton kernel variants compiled (or loaded from
    Triton's disk cache) in this process meanwhile: after a warm-up it should stay empty."""
    compiled: list[str] = []
    try:
        from triton import knobs
    except ImportError:
        knobs = None
    if knobs is None or not hasattr(knobs.runtime, "jit_post_compile_hook"):  # no Triton, or too old
        yield compiled
        return
    previous = knobs.runtime.jit_post_compile_hook
    package = str(Path(__file__).parents[1]) + "/"

    def hook(*_, **kw):
        # The variant (its constexprs close the repr) and the loraplex calls that asked for it.
        calls = [f"{f.filename[len(package):]}:{f.lineno} {f.name}"
                 for f in traceback.extract_stack() if f.filename.startswith(package)][-6:-1]
        compiled.append(f"{kw.get('repr', '?')} called from {' < '.join(reversed(calls))}")
        if previous:
            previous(*_, **kw)

    knobs.runtime.jit_post_compile_hook = hook
    try:
        yield compiled
    finally:
        knobs.runtime.jit_post_compile_hook = previous


def pinned_allocs() -> dict[str, float] | None:
    """Page-locked blocks PyTorch's host allocator created and returned so far, and the
    milliseconds those CUDA calls took."""
    import torch

    if not torch.cuda.is_available() or not hasattr(torch.cuda, "host_memory_stats"):
        return None
    s = torch.cuda.host_memory_stats()
    return {"allocs": s.get("num_host_alloc", 0), "alloc_ms": s.get("host_alloc_time.total", 0) / 1e3,
            "frees": s.get("num_host_free", 0), "free_ms": s.get("host_free_time.total", 0) / 1e3}


def step_profile(steps: list[StepTiming]) -> dict:
    """Where the run's time went, by kind of engine step: decode only, with prefill
    tokens, with adapter slot loads; and the slow steps (over 3x the median). launch_ms:
    the host's time inside runner.launch (planning inputs, slot copies, kernel launches,
    and waiting when the device's launch queue is full; slot_copy_ms of it copying
    adapters into slots); device_ms: from the step's first queued device work starting
    to its last finishing (with one step in flight it starts when the previous one
    ends), so a step the host holds up has launch_ms near its total and device_ms well
    under it; copy_wait_ms / copy_ms: on the copy stream, the wait for the slots' last
    readers (the step in flight) and then the slot copies themselves."""
    if not steps:
        return {}
    ms = sorted(t.total_s * 1e3 for t in steps)
    median = ms[len(ms) // 2]

    def kind(rows: list[StepTiming]) -> dict:
        n = max(1, len(rows))
        out = {"steps": len(rows), "total_s": round(sum(t.total_s for t in rows), 3),
               "mean_ms": round(1e3 * sum(t.total_s for t in rows) / n, 2),
               "launch_ms": round(1e3 * sum(t.launch_s for t in rows) / n, 2),
               "slot_copy_ms": round(1e3 * sum(t.slot_load_s for t in rows) / n, 2)}
        timed = [t.device for t in rows if t.device is not None]
        if timed:
            out["device_ms"] = round(sum(start.elapsed_time(end) for start, end in timed) / len(timed), 2)
        copies = [t.slot_copies for t in rows if t.slot_copies is not None]
        if copies:  # on the copy stream: waiting for the slots' last readers, then copying
            out["copy_wait_ms"] = round(sum(a.elapsed_time(b) for a, b, _ in copies) / len(copies), 2)
            out["copy_ms"] = round(sum(b.elapsed_time(c) for _, b, c in copies) / len(copies), 2)
        return out

    slow = [t for t in steps if t.total_s * 1e3 > 3 * median]
    n_slow = max(1, len(slow))
    return {
        "median_ms": round(median, 2), "total_s": round(sum(ms) / 1e3, 3),
        "decode_only": kind([t for t in steps if t.num_tokens <= 64 and not t.num_slot_loads]),
        "with_prefill": kind([t for t in steps if t.num_tokens > 64]),
        "with_slot_loads": kind([t for t in steps if t.num_slot_loads]),
        "slow": {**kind(slow), "mean_tokens": round(sum(t.num_tokens for t in slow) / n_slow, 1),
                 "mean_slot_loads": round(sum(t.num_slot_loads for t in slow) / n_slow, 2)},
    }
