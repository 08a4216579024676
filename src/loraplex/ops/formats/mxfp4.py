"""MXFP4 checkpoint tensors -> loraplex's canonical Mxfp4Weight (ops/formats).

gpt-oss publishes its experts (and only them) in OCP MXFP4, one whole stack per tensor:

- `...mlp.experts.gate_up_proj_blocks` uint8 [E, 2I, H / 32, 16], `..._scales` uint8
  [E, 2I, H / 32], `..._bias` [E, 2I] (stays in the model's dtype);
- `...mlp.experts.down_proj_blocks` uint8 [E, H, I / 32, 16], `..._scales` [E, H, I / 32],
  `..._bias` [E, H].

Rows are output features ([E, out, in], unlike the bf16 checkpoint's transposed [E, in,
out]); gate_up's rows interleave gate and up (gate = rows 0::2, up = 1::2), which
GptOssCausalLM.checkpoint_transform (models/gpt_oss.py) reorders into gate rows, then up
rows, before they come here. Each row holds K / 32 blocks of 16 bytes, two e2m1 values
per byte, low nibble first: flattened, byte j holds k = 2j (low) and k = 2j + 1 (high).
Mxfp4Weight.data [E, N, K / 2] holds the same bytes with each 4-byte word's bits in
the decode's order (formats/e2m1_words.py; `checkpoint_blocks` gives them back). Scales
are e8m0 (2^(s - 127); 255 is NaN). Reference of the layout: transformers'
integrations/mxfp4.py (`convert_moe_packed_tensors`, FP4_VALUES).
"""

from __future__ import annotations

import torch

from loraplex.config import QuantConfig
from loraplex.errors import ModelLoadError
from loraplex.ops.formats import MXFP4_BLOCK, Mxfp4Weight
from loraplex.ops.formats.checks import expect
from loraplex.ops.formats.e2m1_words import from_nibbles_, to_nibbles

E8M0_NAN = 255
_BYTES_PER_BLOCK = MXFP4_BLOCK // 2


def ingest_mxfp4(w: Mxfp4Weight, quant: QuantConfig, kind: str, tensor: torch.Tensor,
                 name: str) -> tuple[str, ...]:
    """Write the checkpoint tensor `name` (`<proj>_blocks` or `<proj>_scales`, its rows in
    w's order) into w, which is the part of one weight it fills. Raises ModelLoadError
    for any other tensor, a wrong shape or dtype, or a scale that is NaN in e8m0."""
    data, scale = w.data, w.scale
    if kind.endswith("_blocks"):
        *lead, n, k_half = data.shape
        expect(name, tensor, (*lead, n, k_half // _BYTES_PER_BLOCK, _BYTES_PER_BLOCK), torch.uint8)
        from_nibbles_(data.copy_(tensor.reshape(data.shape)))
        return ("data",)
    if kind.endswith("_scales"):
        expect(name, tensor, scale.shape, torch.uint8)
        if (tensor == E8M0_NAN).any():
            raise ModelLoadError(f"{name}: e8m0 scale {E8M0_NAN} (NaN)")
        scale.copy_(tensor)
        return ("scale",)
    raise ModelLoadError(f"{name}: an MXFP4 weight takes only _blocks and _scales tensors")


def checkpoint_blocks(w: Mxfp4Weight) -> torch.Tensor:
    """w's codes as a checkpoint's `_blocks` tensor [..., N, K / 32, 16] (ingest_mxfp4's
    inverse; a model writer's)."""
    *lead, n, k_half = w.data.shape
    return to_nibbles(w.data).reshape(*lead, n, k_half // _BYTES_PER_BLOCK, _BYTES_PER_BLOCK)
