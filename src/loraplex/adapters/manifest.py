"""Content ids: what makes two adapters the same adapter.

An adapter's content id is `sha256:` over a canonical JSON manifest of the config fields
that change its arithmetic and a digest of every tensor (name, dtype, shape, bytes).
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


def tensor_digest(t: torch.Tensor) -> str:
    raw = t.detach().contiguous().view(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(raw)).hexdigest()


def manifest(config: Mapping, tensors: Mapping[str, torch.Tensor]) -> dict:
    return {
        "format": "loraplex-adapter/1",
        "config": {k: config[k] for k in MATH_FIELDS if config.get(k) not in (None, {}, False)},
        "tensors": {
            name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                   "sha256": tensor_digest(t)}
            for name, t in sorted(tensors.items())
        },
    }


def content_id(config: Mapping, tensors: Mapping[str, torch.Tensor]) -> str:
    canonical = json.dumps(manifest(config, tensors), sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()
