"""AWQ and GPTQ int4 checkpoints -> Int4Weight's canonical buffers (ops/formats: data
uint8 [N, K / 2], k = 2j in byte j's low nibble; scale and zero [N, K / G]; W[n, k] =
(q - zero) * scale).

Both store 32-bit words of eight 4-bit values, value i in bits 4i..4i+3, and the
transpose of W's layout ([K, N] roles: rows of K, columns of N). As published:

- AWQ GEMM (AutoAWQ's WQLinear_GEMM, `version: gemm`): qweight int32 [K, N / 8] packed
  along N in AutoAWQ's order: value i of word c holds column 8c + AWQ_ORDER[i]. qzeros
  int32 [K / G, N / 8] packed the same way; scales [K / G, N].
- GPTQ (AutoGPTQ, GPTQModel; desc_act false): qweight int32 [K / 8, N] packed along K:
  value i of row j holds k = 8j + i. qzeros int32 [K / G, N / 8] packed along N in
  order (value i of word c: column 8c + i); scales [K / G, N]; g_idx [K], which must be
  k // G (act-order would permute it: refused). checkpoint_format "gptq" stores every
  zero point minus one (the zero is the stored value + 1, 1..16, as AutoGPTQ's and
  vLLM's kernels read it), "gptq_v2" (GPTQModel) as it is.

Symmetric checkpoints (GPTQ sym, AWQ without zero_point) still carry their zero points,
which must then all be 8 (loraplex's symmetric zero).

A GPTQ qweight is already the canonical bytes of W's transpose: word j of column n is
bytes 4j..4j+3 of row n, low nibble first (little-endian), so it is only transposed. AWQ
words are unpacked and their columns put back in order. The packed words go to the
weight's device first (4 bits a weight), then unpack there.
"""

from __future__ import annotations

import torch

from loraplex.config import QuantConfig
from loraplex.errors import ModelLoadError
from loraplex.ops.formats import Int4Weight
from loraplex.ops.formats.checks import expect, finite_scales

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # value i of an AWQ word holds column 8c + AWQ_ORDER[i]
AWQ_UNDO = tuple(AWQ_ORDER.index(j) for j in range(8))  # column 8c + j is value AWQ_UNDO[j]
PACK = 8  # 4-bit values per int32 word
SYMMETRIC_ZERO = 8
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def ingest_int4(w: Int4Weight, quant: QuantConfig, kind: str, tensor: torch.Tensor,
                name: str) -> tuple[str, ...]:
    """Write one AWQ / GPTQ tensor of a projection (`kind`: qweight, qzeros, scales,
    g_idx) into w, the projection's rows of an Int4Weight; returns the buffers filled.
    Raises ModelLoadError naming the tensor for a wrong shape, dtype or value."""
    n, k = w.shape[-2:]
    group = w.group
    if k % quant.group_size:
        raise ModelLoadError(f"{name}: {k} input features are not a multiple of group_size "
                             f"{quant.group_size}")
    awq = quant.method == "awq"
    if kind == "qweight":
        _words(name, tensor, (k, n // PACK) if awq else (k // PACK, n), n if awq else k)
        t = tensor.to(w.data.device)
        if awq:  # [K, N / 8] -> values [K, N] -> [N, K] -> pairs along K
            q = _unpack(t, AWQ_UNDO).t()
            w.data.copy_(q[:, 0::2] | (q[:, 1::2] << 4))
        else:  # [K / 8, N]: each column's words are its bytes, low nibble first
            w.data.copy_(t.t().reshape(-1).view(torch.uint8).view(n, k // 2))
        return ("data",)
    if kind == "qzeros":
        _words(name, tensor, (k // group, n // PACK), n)
        zero = _unpack(tensor.to(w.zero.device), AWQ_UNDO if awq else tuple(range(PACK))).t()
        if quant.checkpoint_format == "gptq":  # stored minus one
            zero = zero.to(torch.int16) + 1
        if quant.symmetric and (zero != SYMMETRIC_ZERO).any():
            raise ModelLoadError(f"{name}: a symmetric checkpoint's zero points must all be "
                                 f"{SYMMETRIC_ZERO}")
        w.zero.copy_(zero)
        return ("zero",)
    if kind == "scales":
        expect(name, tensor, (k // group, n))
        if tensor.dtype not in SCALE_DTYPES:
            raise ModelLoadError(f"{name}: checkpoint dtype {tensor.dtype}, expected a float dtype")
        finite_scales(name, tensor)
        w.scale.copy_(tensor.t())
        return ("scale",)
    if kind == "g_idx" and not awq:
        expect(name, tensor, (k,))
        if tensor.dtype.is_floating_point or tensor.dtype == torch.bool:
            raise ModelLoadError(f"{name}: checkpoint dtype {tensor.dtype}, expected integers")
        if not torch.equal(tensor.long(), torch.arange(k) // group):
            raise ModelLoadError(f"{name}: g_idx is not k // group_size ({group}): act-order "
                                 "(desc_act) checkpoints are not supported")
        return ()
    raise ModelLoadError(f"{name}: unexpected tensor in a {quant.method} layer")


def _words(name: str, tensor: torch.Tensor, shape: tuple[int, int], packed_dim: int) -> None:
    if packed_dim % PACK:
        raise ModelLoadError(f"{name}: {packed_dim} values do not pack into whole int32 words")
    expect(name, tensor, shape, torch.int32)


def _unpack(words: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """int32 [R, C] -> uint8 [R, 8C]: column 8c + j = value order[j] of word c."""
    r, c = words.shape
    out = torch.empty(r, c, PACK, dtype=torch.uint8, device=words.device)
    for j, i in enumerate(order):
        out[:, :, j] = (words >> (4 * i)) & 0xF
    return out.view(r, c * PACK)
