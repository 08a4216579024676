"""Weight formats of a built model: which layers hold quantized weights (the checkpoint's
tensors become loraplex's canonical layouts in ops/formats/checkpoint.py).

A model is built with its LoRALinear and Experts weights deferred (on the meta device);
`materialize_weights` then gives each one its format: bf16 (the model's dtype), or the
checkpoint's quantized format for every layer the quantization covers. What a layer
holds is read from the checkpoint itself where there is one (a quantized layer has its
scales beside its weight), so checkpoints that keep some layers unquantized load as
published; random weights follow the config's skip patterns.
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from loraplex.config import ModelConfig, QuantConfig
from loraplex.layers.linear import LoRALinear
from loraplex.layers.moe import Experts
from loraplex.ops.formats.checkpoint import QUANTIZED_MARKS, new_weight


def weight_names(module: nn.Module) -> tuple[str, ...]:
    """The weights of a LoRALinear or Experts whose format is chosen at load."""
    return ("gate_up_proj", "down_proj") if isinstance(module, Experts) else ("weight",)


def deferred_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {path: m for path, m in model.named_modules() if isinstance(m, LoRALinear | Experts)}


def quantized_layers(model: nn.Module, cfg: ModelConfig, checkpoint_names: set[str] | None) -> set[str]:
    """Paths of the LoRALinear / Experts modules that hold quantized weights: those whose
    tensors carry the method's marks in the checkpoint (names after the model's
    checkpoint_renames), or (random weights, load-time quantization) those the method
    covers that no skip pattern names."""
    quant = cfg.quant
    if quant is None:
        return set()
    layers = deferred_layers(model)
    # A model may keep some projections in its dtype: DeepSeek's kv_b_proj, which latent
    # attention reads as a tensor (absorbed into queries and outputs). A checkpoint that
    # stores one quantized has it dequantized as it loads (models/weights.py).
    keep = set(getattr(model, "unquantized_modules", ()))
    layers = {path: m for path, m in layers.items()
              if not (isinstance(m, LoRALinear) and keep & set(m.slice_names))}
    if checkpoint_names is None or quant.online:
        return {path for path, m in layers.items() if _covers(quant, path, m)}
    marks = QUANTIZED_MARKS[quant.method]
    marked = {n for n in checkpoint_names if n.endswith(marks)}
    out = set()
    for path, m in layers.items():
        if isinstance(m, LoRALinear):  # its slices are checkpoint modules beside it (q_proj, ...)
            parent = path.rpartition(".")[0]
            prefixes = tuple(f"{parent}.{name}." for name in m.slice_names)
        else:
            prefixes = (f"{path}.",)
        if any(n.startswith(prefixes) for n in marked):
            out.add(path)
    return out


def _covers(quant: QuantConfig, path: str, module: nn.Module) -> bool:
    if isinstance(module, LoRALinear):
        if quant.format == "mxfp4":  # gpt-oss's MXFP4 is its experts alone
            return False
        names = [f"{path.rpartition('.')[0]}.{n}" for n in module.slice_names]
    else:
        if quant.format == "int4":  # AWQ / GPTQ: dense models
            return False
        names = [path]
    return not any(fnmatch.fnmatch(n, p) or fnmatch.fnmatch(n, p + ".*") for n in names for p in quant.skip)


def materialize_weights(model: nn.Module, cfg: ModelConfig, dtype: torch.dtype, device,
                        quantized: set[str]) -> None:
    """Give every deferred weight its storage: quantized for the layers in `quantized`,
    else a parameter in `dtype`."""
    for path, module in deferred_layers(model).items():
        for name in weight_names(module):
            shape = tuple(getattr(module, name).shape)
            delattr(module, name)
            if path in quantized:
                setattr(module, name, new_weight(cfg.quant, shape, dtype, device))
            else:
                setattr(module, name, nn.Parameter(torch.empty(shape, dtype=dtype, device=device), False))
