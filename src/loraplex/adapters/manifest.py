"""Content ids: what makes two adapters the same adapter.

An adapter's content id is `sha256:` over a canonical JSON manifest of the config fields
that change its arithmetic, every tensor's name, dtype and shape, and one digest of all
tensor bytes in name order.
File names, JSON formatting, tensor order in the file and fields that do not affect the
output (base_model_name_or_path, revision, ...) do not change it, so the same weights
published under two names or copied to two places share one copy in every tier.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import torch

# Config fields that change what an adapter computes.
MATH_FIELDS = ("peft_type", "r", "lora_alpha", "use_rslora", "use_dora", "rank_pattern",
               "alpha_pattern", "fan_in_fan_out")


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().view(-1).view(torch.uint8).numpy())


def data_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 of every tensor's bytes, in name order. Tensors that sit back to back in
    one buffer (a file read whole) are hashed as one run: one call, the GIL released."""
    h = hashlib.sha256()
    run_start = run_end = None
    for name in sorted(tensors):
        t = tensors[name]
        ptr = t.data_ptr() if t.is_contiguous() else None
        if ptr is not None and ptr == run_end:
            run_end += t.nbytes
            continue
        if run_start is not None:
            h.update(_span(run_start, run_end))
        if ptr is None:
            h.update(_bytes(t))
            run_start = run_end = None
        else:
            run_start, run_end = ptr, ptr + t.nbytes
    if run_start is not None:
        h.update(_span(run_start, run_end))
    return h.hexdigest()


def _span(start: int, end: int) -> memoryview:
    import ctypes

    return memoryview((ctypes.c_ubyte * (end - start)).from_address(start)).cast("B")


def manifest(config: Mapping, tensors: Mapping[str, torch.Tensor]) -> dict:
    return {
        "format": "loraplex-adapter/1",
        "config": {k: config[k] for k in MATH_FIELDS if config.get(k) not in (None, {}, False)},
        "tensors": {name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                    for name, t in sorted(tensors.items())},
        "data_sha256": data_digest(tensors),
    }


def content_id(config: Mapping, tensors: Mapping[str, torch.Tensor]) -> str:
    canonical = json.dumps(manifest(config, tensors), sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()
