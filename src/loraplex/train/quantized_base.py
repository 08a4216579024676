"""Loading a quantized base for LoRA training: MXFP4 (gpt-oss), FP8 (block-scaled or
compressed-tensors), AWQ / GPTQ int4 checkpoints, or a bf16 checkpoint quantized to FP8
as it loads (`--quantization fp8`). The adapter stays float32 / bf16 on top, as in PEFT.

`load_quantized_base` builds transformers' model with its parameters on the meta device
(no bf16 copy of the base is ever made), then fills it from the checkpoint tensor by
tensor: quantized layers' tensors into their formats through the same conversion and
checks as serving (ops/formats/checkpoint.py), held as train/quantized.py's frozen
weights; every other tensor into the parameter of its name. Checkpoints name tensors as
transformers' modules do, or (MoE checkpoints) one expert at a time
(`experts.<e>.gate_proj` / `up_proj` / `down_proj`, stacked here into the fused [E, ...]
parameters).
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import torch
from torch import nn

from loraplex.config import QUANTIZATION_METHODS, QuantConfig
from loraplex.errors import ModelLoadError
from loraplex.ops.formats import QuantizedWeight
from loraplex.ops.formats.checkpoint import (
    QUANTIZED_MARKS,
    ingest,
    init_quantized,
    new_weight,
    safetensors_files,
)
from loraplex.train.quantized import FrozenWeight, QuantizedLinear

# Projections a load-time or random quantization covers (routers, embeddings and the
# head stay in the model's dtype, as serving keeps them).
QUANTIZED_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                         "kv_b_proj", "gate_proj", "up_proj", "down_proj")
EXPERT_STACKS = ("gate_up_proj", "down_proj")
_PER_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\."
                         r"(?P<kind>\w+)$")


def is_quantized_checkpoint(model_dir: str | Path) -> bool:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return bool(config.get("quantization_config"))


@contextlib.contextmanager
def _parameters_on_meta():
    """Modules built inside put their parameters on the meta device (no memory; nothing
    initialised) and keep their buffers (rotary tables, computed at construction)."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def base_quantization(hf_config, quantization: str | None, dummy: bool = False) -> QuantConfig:
    """The checkpoint's quantization, or `quantization` applied to a bf16 checkpoint as it
    loads (fp8 only, per row and 128 columns as serving's --quantization fp8), or to
    random weights (`dummy`: any method's format, as serving's dummy weights)."""
    arch = (getattr(hf_config, "architectures", None) or ["?"])[0]
    q = getattr(hf_config, "quantization_config", None)
    if q:
        q = q if isinstance(q, dict) else q.to_dict()
        quant = QuantConfig.from_hf(arch, q)
        if quantization not in (None, quant.method):
            raise ModelLoadError(f"the checkpoint is {quant.method}-quantized; --quantization {quantization} "
                                 "cannot apply to it")
        return quant
    if dummy and quantization in QUANTIZATION_METHODS:
        return QuantConfig.requested(quantization, online=False)
    if quantization != "fp8":
        raise ModelLoadError(f"--quantization {quantization}: a bf16 checkpoint is quantized as it loads "
                             "only to fp8; other formats train from a checkpoint quantized so")
    return QuantConfig.requested("fp8", online=True)


def _checkpoint_names(model_dir: Path) -> set[str]:
    from safetensors import safe_open

    names = set()
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    return names


def _checkpoint_tensors(model_dir: Path):
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


class _Builder:
    """Fills a meta-parameter transformers model from checkpoint tensors."""

    def __init__(self, model: nn.Module, quant: QuantConfig, device, dtype):
        self.model, self.quant, self.device, self.dtype = model, quant, torch.device(device), dtype
        self.params = dict(model.named_parameters())
        self.modules = dict(model.named_modules())
        self.frozen: dict[str, FrozenWeight] = {}  # "module.param" -> its quantized weight
        self.filled: dict[str, set[str]] = {}  # of each frozen weight: the buffers written
        # Parameters that alias another (a head tied to the embeddings): not read.
        unique = {id(p) for p in self.params.values()}
        self.aliases = {n for n, p in model.named_parameters(remove_duplicate=False)
                        if n not in self.params and id(p) in unique}

    def frozen_weight(self, path: str, param: str) -> FrozenWeight:
        key = f"{path}.{param}"
        if key not in self.frozen:
            module = self.modules[path]
            shape = tuple(getattr(module, param).shape)
            transposed = bool(getattr(module, "is_transposed", False)) and param in EXPERT_STACKS
            canonical = (*shape[:-2], shape[-1], shape[-2]) if transposed else shape
            weight = new_weight(self.quant, canonical, self.dtype, self.device)
            self.frozen[key] = FrozenWeight(weight, transposed)
            self.filled[key] = set()
        return self.frozen[key]

    def ingest(self, path: str, param: str, kind: str, tensor: torch.Tensor, index: tuple, name: str) -> None:
        w = self.frozen_weight(path, param)
        if self.quant.online and w.transposed:
            tensor = tensor.transpose(-1, -2)  # the checkpoint's [E, in, out] -> canonical rows
        tensor = tensor.to(self.device)
        self.filled[f"{path}.{param}"].update(ingest(w.qweight, self.quant, kind, tensor, index, name))

    def set_param(self, name: str, tensor: torch.Tensor) -> None:
        path, _, attr = name.rpartition(".")
        old = self.params.pop(name)
        if tuple(tensor.shape) != tuple(old.shape):
            raise ModelLoadError(f"{name}: checkpoint shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(old.shape)}")
        dtype = self.dtype if tensor.is_floating_point() else tensor.dtype
        setattr(self.modules[path], attr, nn.Parameter(tensor.to(self.device, dtype), requires_grad=False))

    def quantizes(self, path: str, param: str) -> bool:
        """Load-time quantization and random weights: the projections and expert stacks."""
        module = self.modules.get(path)
        stack = getattr(module, param, None) if param in EXPERT_STACKS else None
        if stack is not None and stack.dim() == 3:
            return self.quant.format != "int4"  # int4: dense projections only (as served)
        return (param == "weight" and path.rpartition(".")[2] in QUANTIZED_PROJECTIONS
                and isinstance(module, nn.Linear) and self.quant.format != "mxfp4")  # MXFP4: experts only

    def add(self, name: str, tensor: torch.Tensor, marked: set[str]) -> None:
        """One checkpoint tensor. `marked`: the modules whose checkpoint tensors carry the
        method's quantization marks."""
        m = _PER_EXPERT.match(name)
        stack = m and f"{m['experts']}.gate_up_proj"
        if stack and (stack in self.params or stack in self.frozen):
            experts, e, proj, kind = m["experts"], int(m["e"]), m["proj"], m["kind"]
            param = "down_proj" if proj == "down_proj" else "gate_up_proj"
            if f"{experts}.{e}.{proj}" in marked or (self.quant.online and self.quantizes(experts, param)):
                inter = self.modules[experts].down_proj.shape[-1]
                rows = {"gate_proj": slice(0, inter), "up_proj": slice(inter, 2 * inter),
                        "down_proj": slice(None)}[proj]
                self.ingest(experts, param, kind, tensor, (e, rows), name)
                return
            raise ModelLoadError(f"{name}: per-expert tensors of an unquantized experts module are not read "
                                 "here; train this base from its bf16 checkpoint")
        path, _, kind = name.rpartition(".")
        if self.quant.method == "mxfp4" and kind.endswith(("_blocks", "_scales")):
            param = kind.rsplit("_", 1)[0]
            self.ingest(path, param, kind, tensor, (), name)
            return
        linear = isinstance(self.modules.get(path), nn.Linear)
        if (linear and path in marked and kind != "bias") or (
                self.quant.online and kind == "weight" and self.quantizes(path, "weight")):
            self.ingest(path, "weight", kind, tensor, (), name)
            return
        if self.quant.online and name in self.params and self.quantizes(path, kind):
            self.ingest(path, kind, "weight", tensor, (), name)
            return
        if name in self.aliases:
            return
        if name not in self.params:
            raise ModelLoadError(f"{name}: no parameter of {type(self.model).__name__} has this name")
        self.set_param(name, tensor)

    def finish(self) -> None:
        """Install the quantized weights; check that every one and every parameter was filled."""
        for key, w in self.frozen.items():
            missing = {b for b, _ in w.qweight.named_buffers(recurse=False)} - self.filled[key]
            if missing and not self.quant.online:
                raise ModelLoadError(f"{key}: the checkpoint lacks its {sorted(missing)}")
            path, _, param = key.rpartition(".")
            module = self.modules[path]
            self.params.pop(key, None)
            if isinstance(module, nn.Linear):  # (a bias missing from the checkpoint stays in params)
                bias = None if module.bias is None or module.bias.is_meta else module.bias.data
                parent, _, attr = path.rpartition(".")
                setattr(self.modules[parent], attr, QuantizedLinear(w, bias))
            else:
                delattr(module, param)
                setattr(module, param, w)
        if self.aliases:  # re-tie what the new parameters untied
            self.model.tie_weights()
        if self.params:
            raise ModelLoadError(f"not in the checkpoint: {sorted(self.params)[:5]}")
        for module in self.model.modules():
            for name, b in module.named_buffers(recurse=False):
                if not isinstance(module, QuantizedWeight):
                    module._buffers[name] = b.to(self.device)


def load_quantized_base(model_dir: str | Path, device, dtype: torch.dtype, quantization: str | None = None,
                        dummy: bool = False, seed: int = 0,
                        attn_implementation: str | None = None) -> nn.Module:
    """transformers' model of `model_dir` with its quantized layers frozen in their
    format (module docstring); `dummy`: random weights at trained scale instead of the
    checkpoint's (N(0, initializer_range) quantized into the format; norms 1)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = Path(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    quant = base_quantization(config, quantization, dummy)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # transformers must neither quantize nor dequantize
    with _parameters_on_meta():
        kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
    builder = _Builder(model, quant, device, dtype)
    if dummy:
        _random_weights(builder, config, seed)
    else:
        names = _checkpoint_names(model_dir)
        marks = QUANTIZED_MARKS[quant.method]
        marked = set() if quant.online else {n.rpartition(".")[0] for n in names if n.endswith(marks)}
        for name, tensor in _checkpoint_tensors(model_dir):
            builder.add(name, tensor, marked)
    builder.finish()
    model.config.use_cache = False
    return model


def _random_weights(builder: _Builder, config, seed: int) -> None:
    gen = torch.Generator(builder.device).manual_seed(seed)
    std = getattr(config, "initializer_range", 0.02)
    for name, p in list(builder.params.items()):
        path, _, attr = name.rpartition(".")
        if builder.quantizes(path, attr):
            init_quantized(builder.frozen_weight(path, attr).qweight, std, gen)
            builder.filled[name] = {b for b, _ in builder.frozen[name].qweight.named_buffers(recurse=False)}
            continue
        t = torch.empty(p.shape, dtype=torch.float32, device=builder.device)
        if "norm" in path or attr.endswith("norm"):
            t.fill_(0.0 if getattr(config, "model_type", "").startswith("gemma") else 1.0)
        else:
            t.normal_(0.0, std, generator=gen)
        builder.set_param(name, t)
