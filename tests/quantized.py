"""Checkpoints in the layouts quantized models are published in, written from a tiny
bf16/fp32 model, beside the same model with the dequantized weights (the oracle's)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# The decoder's linear weights a quantized checkpoint stores quantized (routers stay as they are).
LINEAR = re.compile(r"\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj"
                    r"|mlp\.experts\.\d+\.(gate|up|down)_proj)\.weight$")


def _rewrite(src: Path, quantized_dir: Path, oracle_dir: Path, quantization_config: dict, convert) -> None:
    """Both directories start as copies of src; each linear weight W becomes convert(name,
    W) -> (quantized tensors by name, dequantized W) in them."""
    for d in (quantized_dir, oracle_dir):
        shutil.copytree(src, d)
    tensors = load_file(str(src / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, t in tensors.items():
        if LINEAR.search(name):
            parts, w = convert(name, t)
            quantized.update(parts)
            dequantized[name] = w.to(t.dtype)
        else:
            quantized[name] = dequantized[name] = t
    save_file(quantized, str(quantized_dir / "model.safetensors"))
    save_file(dequantized, str(oracle_dir / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (quantized_dir / "config.json").write_text(json.dumps(config))


def fp8_block_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, weight_scale_inv [ceil(N / bn), ceil(K / bk)]) as DeepSeek / Qwen
    FP8 checkpoints hold them: W ~= weight * scale_inv, one scale per [bn, bk] block."""
    n, k = w.shape
    bn, bk = block
    padded = torch.nn.functional.pad(w.float(), (0, -k % bk, 0, -n % bn))
    blocks = padded.unflatten(0, (-1, bn)).unflatten(2, (-1, bk))  # [N/bn, bn, K/bk, bk]
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).flatten(2).flatten(0, 1)[:n, :k]
    return q.to(torch.float8_e4m3fn), scale


def fp8_block_dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    n, k = q.shape
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:n, :k]
    return q.float() * full


def write_fp8_block(src: Path, out: Path, block=(128, 128)) -> tuple[Path, Path]:
    """(the FP8 checkpoint, its dequantized twin) of the model at src."""
    def convert(name, t):
        q, scale = fp8_block_quantize(t, block)
        return {name: q, f"{name}_scale_inv": scale}, fp8_block_dequantize(q, scale, block)

    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": list(block)}
    quantized_dir, oracle_dir = out / "fp8", out / "dequantized"
    _rewrite(src, quantized_dir, oracle_dir, config, convert)
    return quantized_dir, oracle_dir



def write_dequantized(src: Path, out: Path, round_trip) -> Path:
    """src with each linear weight W replaced by round_trip(W) (quantized and back): the
    oracle of a model quantized as it loads."""
    def convert(name, t):
        return {name: t}, round_trip(t)

    _rewrite(src, out / "unused", out / "dequantized", {}, convert)
    return out / "dequantized"
