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

from loraplex.adapters.safetensors_io import TensorFile, memory_span, tensor_meta

# Config fields that change what an adapter computes.
MATH_FIELDS = ("peft_type", "r", "lora_alpha", "use_rslora", "use_dora", "rank_pattern",
               "alpha_pattern", "fan_in_fan_out")


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().view(-1).view(torch.uint8).numpy())


def data_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 of every tensor's bytes, in name order. Tensors that sit back to back in
    one buffer (a file read whole) are hashed as one run: one call, the GIL released."""
    if isinstance(tensors, TensorFile):  # from the header's offsets: no tensor views
        spans = [(e.begin, e.end) for _, e in sorted(tensors.entries.items())]
        return _digest_runs(spans, lambda b, e: tensors.bytes(b, e).data)
    spans = []
    for name in sorted(tensors):
        t = tensors[name]
        if t.is_contiguous():
            spans.append((t.data_ptr(), t.data_ptr() + t.nbytes))
        else:  # hashed on its own, from a contiguous copy
            spans.append((None, _bytes(t)))
    return _digest_runs(spans, memory_span)


def _digest_runs(spans: list[tuple], read) -> str:
    """spans: (begin, end) addresses in name order, or (None, bytes) for a copied tensor;
    adjacent spans are hashed as one run."""
    h = hashlib.sha256()
    run = None
    for begin, end in spans:
        if begin is not None and run is not None and run[1] == begin:
            run = (run[0], end)
            continue
        if run is not None:
            h.update(read(*run))
            run = None
        if begin is None:
            h.update(end)
        else:
            run = (begin, end)
    if run is not None:
        h.update(read(*run))
    return h.hexdigest()


def manifest(config: Mapping, tensors: Mapping[str, torch.Tensor]) -> dict:
    return {
        "format": "loraplex-adapter/1",
        "config": {k: config[k] for k in MATH_FIELDS if config.get(k) not in (None, {}, False)},
        "tensors": {name: {"dtype": str(dtype).removeprefix("torch."), "shape": list(shape)}
                    for name, (dtype, shape) in sorted(tensor_meta(tensors).items())},
        "data_sha256": data_digest(tensors),
    }


def content_id(config: Mapping, tensors: Mapping[str, torch.Tensor]) -> str:
    canonical = json.dumps(manifest(config, tensors), sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()
