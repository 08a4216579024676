"""Weight formats of a built model: which layers hold quantized weights, and how each
checkpoint's quantized tensors become loraplex's canonical layouts (ops/formats.py).

A model is built with its LoRALinear and Experts weights deferred (on the meta device);
`materialize_weights` then gives each one its format: bf16 (the model's dtype), or the
checkpoint's quantized format for every layer the quantization covers. What a layer
holds is read from the checkpoint itself where there is one (a quantized layer has its
scales beside its weight), so checkpoints that keep some layers unquantized load as
published; random weights follow the config's skip patterns.
"""

from __future__ import annotations

import fnmatch
import math

import torch
from torch import nn

from loraplex import ops
from loraplex.config import ModelConfig, QuantConfig
from loraplex.errors import ModelLoadError
from loraplex.layers.linear import LoRALinear
from loraplex.layers.moe import Experts
from loraplex.ops.formats import Fp8Weight, Int4Weight, Mxfp4Weight, QuantizedWeight

# The checkpoint tensors (name suffixes) that mark a layer as quantized, per method.
QUANTIZED_MARKS = {
    "fp8": ("weight_scale_inv",),
    "compressed-tensors": ("weight_scale",),
    "awq": ("qweight",),
    "gptq": ("qweight",),
    "mxfp4": ("_blocks",),
}


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
    if checkpoint_names is None or quant.online:
        # A model may keep some projections in its dtype: DeepSeek's kv_b_proj, which
        # latent attention reads as a tensor (absorbed into queries and outputs).
        keep = set(getattr(model, "unquantized_modules", ()))
        return {path for path, m in layers.items() if _covers(quant, path, m)
                and not (isinstance(m, LoRALinear) and keep & set(m.slice_names))}
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


def new_weight(quant: QuantConfig, shape: tuple[int, ...], dtype: torch.dtype, device) -> QuantizedWeight:
    """An empty weight of logical `shape` in quant's format."""
    if quant.format == "fp8":
        block_k = quant.weight_block[1] or shape[-1]
        return Fp8Weight(shape, block_k, dtype, device)
    if quant.format == "int4":  # (random weights of a small model: a group per row)
        k = shape[-1]
        return Int4Weight(shape, quant.group_size if k % quant.group_size == 0 else k, dtype, device)
    return Mxfp4Weight(shape, dtype, device)


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


def init_quantized(w: QuantizedWeight, std: float, gen: torch.Generator) -> None:
    """Random weights at trained scale: N(0, std) quantized into w's format, in row
    chunks (a bf16 copy of a whole expert stack would not fit beside the model)."""
    rows = w.data.view(-1, w.data.shape[-1]).shape[0]
    k = w.shape[-1]
    flat = {name: t.view(rows, t.shape[-1]) for name, t in w.named_buffers(recurse=False)}
    chunk = max(1, (64 << 20) // (4 * k))
    for r0 in range(0, rows, chunk):
        r1 = min(rows, r0 + chunk)
        values = torch.empty(r1 - r0, k, dtype=torch.float32, device=w.device)
        values.normal_(0.0, std, generator=gen)
        ops.quantize(_view(w, {name: t[r0:r1] for name, t in flat.items()}), values)


def _view(w: QuantizedWeight, buffers: dict[str, torch.Tensor]) -> QuantizedWeight:
    """A weight of w's format over other tensors (views of w's), for writing parts of w."""
    view = object.__new__(type(w))
    nn.Module.__init__(view)
    view.__dict__.update({k: v for k, v in w.__dict__.items() if not k.startswith("_")})
    for name, t in buffers.items():
        view.register_buffer(name, t)
    return view


# -- checkpoint tensors -> canonical buffers ----------------------------------------------

def ingest(w: QuantizedWeight, quant: QuantConfig, kind: str, tensor: torch.Tensor,
           index: tuple, name: str) -> tuple[str, ...]:
    """Write the checkpoint tensor `name` (its last part `kind`) into w at `index` (the
    leading indices and the row slice of one checkpoint module in w); returns the buffers
    it filled (none for a tensor this format stores nowhere). Raises ModelLoadError for a
    tensor of the wrong shape, dtype or values."""
    part = _view(w, {b: t[index] for b, t in w.named_buffers(recurse=False)})
    if quant.online:  # a bf16 checkpoint quantized as it loads
        if kind != "weight":
            return ()
        _expect(name, tensor, part.shape)
        ops.quantize(part, tensor)
        return tuple(b for b, _ in part.named_buffers(recurse=False))
    if isinstance(w, Fp8Weight):
        return _ingest_fp8(part, quant, kind, tensor, name)
    if isinstance(w, Int4Weight):  # AWQ, GPTQ
        from loraplex.models.quant_int4 import ingest_int4

        return ingest_int4(part, quant, kind, tensor, name)
    from loraplex.models.quant_mxfp4 import ingest_mxfp4

    return ingest_mxfp4(part, quant, kind, tensor, name)


def _expect(name: str, tensor: torch.Tensor, shape: tuple, dtype: torch.dtype | None = None) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise ModelLoadError(f"{name}: checkpoint shape {tuple(tensor.shape)}, expected {tuple(shape)}")
    if dtype is not None and tensor.dtype != dtype:
        raise ModelLoadError(f"{name}: checkpoint dtype {tensor.dtype}, expected {dtype}")


def _finite_scales(name: str, scale: torch.Tensor) -> None:
    if not torch.isfinite(scale).all() or (scale <= 0).any():
        raise ModelLoadError(f"{name}: scales must be finite and positive")


def _ingest_fp8(w: Fp8Weight, quant: QuantConfig, kind: str, tensor: torch.Tensor,
                name: str) -> tuple[str, ...]:
    """fp8 (DeepSeek / Qwen block-scaled): `weight` e4m3 and `weight_scale_inv` [ceil(n /
    bn), ceil(k / bk)]. compressed-tensors (llm-compressor's float-quantized FP8, as
    compressed_tensors' initialize_qparams shapes them): `weight` e4m3 and `weight_scale`
    [n, 1] (strategy channel) or [1] (tensor) in the original weight's float dtype; a
    `weight_zero_point` (symmetric checkpoints of older versions) must be all zero."""
    data, scale = w.data, w.scale
    n, k = data.shape[-2:]
    if kind == "weight":
        _expect(name, tensor, data.shape, torch.float8_e4m3fn)
        data.copy_(tensor)
        return ("data",)
    if quant.method == "fp8":
        if kind == "weight_scale_inv":  # [ceil(n / bn), ceil(k / bk)] blocks: one scale per row here
            bn, bk = quant.weight_block
            _expect(name, tensor, (*data.shape[:-2], math.ceil(n / bn), math.ceil(k / bk)))
            _finite_scales(name, tensor)
            scale.copy_(tensor.float().repeat_interleave(bn, dim=-2)[..., :n, :])
            return ("scale",)
        return ()
    # compressed-tensors: per channel (weight_block (1, 0)) or per tensor ((0, 0)); the
    # weight's scale columns are one (block_k = K).
    per_channel = quant.weight_block == (1, 0)
    shape = (*data.shape[:-2], n, 1) if per_channel else (1,)
    if kind == "weight_scale":
        _expect(name, tensor, shape)
        if tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise ModelLoadError(f"{name}: checkpoint dtype {tensor.dtype}, expected a float dtype")
        _finite_scales(name, tensor)
        scale.copy_(tensor.float().reshape(*data.shape[:-2], -1, 1).expand(scale.shape))
        return ("scale",)
    if kind == "weight_zero_point":
        _expect(name, tensor, shape)
        if (tensor.float() != 0).any():
            raise ModelLoadError(f"{name}: nonzero zero points in a symmetric checkpoint")
        return ()
    raise ModelLoadError(f"{name}: not a tensor of compressed-tensors FP8 checkpoints "
                         "(weight, weight_scale)")
