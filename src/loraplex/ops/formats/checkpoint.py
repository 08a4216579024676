"""Checkpoint tensors -> loraplex's canonical quantized weights (ops/formats): an empty
weight of a format (`new_weight`), random weights at trained scale (`init_quantized`),
the weight files of a checkpoint directory, and `ingest`, which writes one published
checkpoint tensor (FP8 block-scaled or
compressed-tensors here; AWQ / GPTQ in formats/int4.py; MXFP4 in formats/mxfp4.py) into
its part of a weight, checking shape, dtype and scales. Serving's loader
(models/weights.py) and training on a quantized base (train/quantized_base.py) both read
checkpoints through it.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from loraplex.config import QuantConfig
from loraplex.errors import ModelLoadError
from loraplex.ops.formats import Fp8Weight, Int4Weight, Mxfp4Weight, QuantizedWeight
from loraplex.ops.formats.checks import expect, finite_scales
from loraplex.ops.formats.int4 import ingest_int4
from loraplex.ops.formats.mxfp4 import ingest_mxfp4
from loraplex.ops.reference.quant import dequantize, quantize

# The checkpoint tensors (name suffixes) that mark a layer as quantized, per method.
QUANTIZED_MARKS = {
    "fp8": ("weight_scale_inv",),
    "compressed-tensors": ("weight_scale",),
    "awq": ("qweight",),
    "gptq": ("qweight",),
    "mxfp4": ("_blocks",),
}


def stored_quantized(quant: QuantConfig, kind: str, tensor: torch.Tensor) -> bool:
    """Whether a checkpoint tensor (its name's last part `kind`) is part of a weight stored
    in quant's FP8 format: the e4m3 weight, or its scales."""
    return quant.format == "fp8" and (kind in QUANTIZED_MARKS[quant.method]
                                      or (kind == "weight" and tensor.dtype == torch.float8_e4m3fn))


def dequantized_weight(quant: QuantConfig, parts: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The float32 weight that FP8 parts of the module `name` stand for (kind -> tensor, as
    stored_quantized picks them), once the weight and its scales have all come; else None.
    For a layer its model keeps in its dtype (DeepSeek's kv_b_proj) in a checkpoint that
    stores it quantized."""
    if "weight" not in parts or not set(QUANTIZED_MARKS[quant.method]) <= set(parts):
        return None
    w = new_weight(quant, tuple(parts["weight"].shape), torch.float32, "cpu")
    for kind, tensor in parts.items():
        ingest(w, quant, kind, tensor, (), f"{name}.{kind}")
    return dequantize(w)


def new_weight(quant: QuantConfig, shape: tuple[int, ...], dtype: torch.dtype, device) -> QuantizedWeight:
    """An empty weight of logical `shape` in quant's format."""
    if quant.format == "fp8":
        block_k = quant.weight_block[1] or shape[-1]
        return Fp8Weight(shape, block_k, dtype, device, act_block=quant.act_block,
                         act_min_tokens=quant.act_min_tokens)
    if quant.format == "int4":  # (random weights of a small model: a group per row)
        k = shape[-1]
        return Int4Weight(shape, quant.group_size if k % quant.group_size == 0 else k, dtype, device)
    return Mxfp4Weight(shape, dtype, device)


def init_quantized(w: QuantizedWeight, std: float, gen: torch.Generator) -> None:
    """Random weights at trained scale: N(0, std) quantized into w's format, in row
    chunks (a bf16 copy of a whole expert stack would not fit beside the model)."""
    k = w.shape[-1]
    for r0, r1, part in row_parts(w, max(1, (64 << 20) // (4 * k))):
        values = torch.empty(r1 - r0, k, dtype=torch.float32, device=w.device)
        values.normal_(0.0, std, generator=gen)
        quantize(part, values)


def row_parts(w: QuantizedWeight, rows_per_part: int):
    """w's rows (every leading index's, flattened) in parts: (r0, r1, a weight of w's
    format over rows r0..r1 - 1, views of w's buffers), for work in bounded pieces."""
    rows = w.data.reshape(-1, w.data.shape[-1]).shape[0]
    flat = {name: t.view(rows, t.shape[-1]) for name, t in w.named_buffers(recurse=False)}
    for r0 in range(0, rows, rows_per_part):
        r1 = min(rows, r0 + rows_per_part)
        yield r0, r1, _view(w, {name: t[r0:r1] for name, t in flat.items()})


def leading_slice(w: QuantizedWeight, i0: int, i1: int) -> QuantizedWeight:
    """w[i0:i1] along its first dimension (e.g. experts of a stack), as views."""
    return _view(w, {name: t[i0:i1] for name, t in w.named_buffers(recurse=False)})


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """A checkpoint directory's weight files, in order."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"no *.safetensors weights in {model_dir} (pickled .bin checkpoints are not "
            "loaded; use load_format='dummy' for random weights)"
        )
    return files


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
        expect(name, tensor, part.shape)
        quantize(part, tensor)
        return tuple(b for b, _ in part.named_buffers(recurse=False))
    if isinstance(w, Fp8Weight):
        return _ingest_fp8(part, quant, kind, tensor, name)
    if isinstance(w, Int4Weight):  # AWQ, GPTQ
        return ingest_int4(part, quant, kind, tensor, name)
    return ingest_mxfp4(part, quant, kind, tensor, name)


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
        expect(name, tensor, data.shape, torch.float8_e4m3fn)
        data.copy_(tensor)
        return ("data",)
    if quant.method == "fp8":
        if kind == "weight_scale_inv":  # [ceil(n / bn), ceil(k / bk)] blocks: one scale per row here
            bn, bk = quant.weight_block
            expect(name, tensor, (*data.shape[:-2], math.ceil(n / bn), math.ceil(k / bk)))
            finite_scales(name, tensor)
            scale.copy_(tensor.float().repeat_interleave(bn, dim=-2)[..., :n, :])
            return ("scale",)
        return ()
    # compressed-tensors: per channel (weight_block (1, 0)) or per tensor ((0, 0)); the
    # weight's scale columns are one (block_k = K).
    per_channel = quant.weight_block == (1, 0)
    shape = (*data.shape[:-2], n, 1) if per_channel else (1,)
    if kind == "weight_scale":
        expect(name, tensor, shape)
        if tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise ModelLoadError(f"{name}: checkpoint dtype {tensor.dtype}, expected a float dtype")
        finite_scales(name, tensor)
        scale.copy_(tensor.float().reshape(*data.shape[:-2], -1, 1).expand(scale.shape))
        return ("scale",)
    if kind == "weight_zero_point":
        expect(name, tensor, shape)
        if (tensor.float() != 0).any():
            raise ModelLoadError(f"{name}: nonzero zero points in a symmetric checkpoint")
        return ()
    raise ModelLoadError(f"{name}: not a tensor of compressed-tensors FP8 checkpoints "
                         "(weight, weight_scale)")
