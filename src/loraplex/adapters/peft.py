"""PEFT LoRA adapters (adapter_config.json + adapter_model.safetensors) -> LoRAAdapter.

Everything an adapter directory can get wrong is checked here, before any weight reaches
a GPU slot, and reported as a typed error naming the adapter. Nothing in the files is
skipped silently: a tensor this model cannot apply is an error.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from loraplex.errors import AdapterInvalid, AdapterNotFound, AdapterTooLarge

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


@dataclass
class LoRAAdapter:
    """One adapter in loraplex's canonical form, in host memory."""

    key: str
    name: str
    path: str
    rank: int  # the largest rank over its modules
    # Module path (e.g. "model.layers.0.self_attn.q_proj") -> (A [r, in], B [out, r]),
    # float32, with the adapter's scaling already multiplied into B.
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _pattern_value(patterns: Mapping[str, float], module: str, default: float) -> float:
    # PEFT's rank_pattern / alpha_pattern: a key matches a module path suffix (regex).
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def load_peft_adapter(
    key: str,
    name: str,
    path: str | Path,
    projections: Mapping[str, tuple[int, int]],
    max_rank: int,
) -> LoRAAdapter:
    """Read and validate a PEFT LoRA directory.

    projections: module path -> (in_features, out_features) of every projection the
    model can adapt.
    """
    path = Path(path)
    config_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not config_file.is_file():
        raise AdapterNotFound(name, f"no {CONFIG_FILE} in {str(path)!r}")
    if not weights_file.is_file():
        if (path / "adapter_model.bin").is_file():
            raise AdapterInvalid(name, "pickled adapter_model.bin is not loaded; save as safetensors")
        raise AdapterNotFound(name, f"no {WEIGHTS_FILE} in {str(path)!r}")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterInvalid(name, f"{CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise AdapterInvalid(name, f"{CONFIG_FILE} is not a JSON object")
    _check_config(name, config)
    try:
        tensors = load_file(str(weights_file))
    except (SafetensorError, OSError, ValueError) as e:
        raise AdapterInvalid(name, f"unreadable {WEIGHTS_FILE}: {e}") from None

    halves: dict[str, dict[str, torch.Tensor]] = {}
    for tensor_name, t in tensors.items():
        m = _KEY.match(tensor_name)
        if m is None:
            raise AdapterInvalid(name, f"unsupported tensor {tensor_name!r}")
        module = m["module"]
        if module not in projections:
            raise AdapterInvalid(name, f"targets {module!r}, which this model cannot adapt")
        halves.setdefault(module, {})[m["ab"]] = t
    if not halves:
        raise AdapterInvalid(name, f"{WEIGHTS_FILE} holds no LoRA weights")

    use_rslora = bool(config.get("use_rslora", False))
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    weights = {}
    for module, ab in sorted(halves.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterInvalid(name, f"{module} has lora_{''.join(ab)} but not both A and B")
        a, b = ab["A"], ab["B"]
        in_f, out_f = projections[module]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape != (out_f, r):
            raise AdapterInvalid(
                name,
                f"{module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit "
                f"a {in_f} -> {out_f} projection",
            )
        if r > max_rank:
            raise AdapterTooLarge(name, f"rank {r} of {module} exceeds max_lora_rank={max_rank}")
        cfg_r = _pattern_value(rank_pattern, module, config.get("r", r))
        if cfg_r != r:
            raise AdapterInvalid(name, f"{module}: weights have rank {r}, config says {cfg_r}")
        alpha = _pattern_value(alpha_pattern, module, config.get("lora_alpha", r))
        scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
        a, b = a.float(), b.float()
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterInvalid(name, f"{module} has NaN or infinite weights")
        weights[module] = (a.contiguous(), (b * scaling).contiguous())
    rank = max(a.shape[0] for a, _ in weights.values())
    return LoRAAdapter(key=key, name=name, path=str(path), rank=rank, weights=weights)


def _check_config(name: str, config: dict) -> None:
    def unsupported(what):
        raise AdapterInvalid(name, f"{what} is not supported")

    if config.get("peft_type", "LORA") != "LORA":
        unsupported(f"peft_type {config['peft_type']!r}")
    if config.get("use_dora"):
        unsupported("DoRA (use_dora)")
    if config.get("modules_to_save"):
        unsupported(f"modules_to_save {config['modules_to_save']}")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        unsupported("LoRA bias")
    if config.get("target_parameters"):
        unsupported(f"target_parameters {config['target_parameters']} on this model")
    for field in ("r", "lora_alpha"):
        value = config.get(field)
        if value is not None and (not isinstance(value, (int, float)) or value <= 0):
            raise AdapterInvalid(name, f"{field} must be a positive number, got {value!r}")
