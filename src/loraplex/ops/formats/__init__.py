"""Quantized weight formats: what a layer holds in place of a bf16 weight W [..., N, K].

Every format is a module of buffers (so it moves with its layer) in one canonical layout
per kind, whatever checkpoint it came from (models/quant.py converts): N output rows
(the layout a fused layer's slices concatenate along), K packed or blocked along the row.
Ops dispatch on the type (ops.linear, ops.fused_experts); ops.dequantize gives W back,
which is every kernel's oracle. Adapters never see these: LoRA deltas stay bf16 on top.

- Fp8Weight: W[n, k] = data[n, k] * scale[n, k // block_k] (e4m3). Block-scaled
  checkpoints ([128, 128] blocks, weight_scale_inv) keep one scale per row and 128 K
  columns (a block's scale repeated over its rows: fused slices need not align to 128
  rows); per-channel ones block_k = K. Ops read dequantize(W) and leave the
  activations as they are, unless `act_block` is set (W8A8, `--fp8-activations
  dynamic` on block-scaled weights, as their configs' activation_scheme asks): then the
  activations are quantized too, per token and block_k columns, and the GEMM
  multiplies e4m3 by e4m3; with `act_min_tokens` (`--fp8-activations prefill`) only in
  GEMMs of that many rows or more, fewer read them as they are.
- Int4Weight: W[n, k] = (q[n, k] - zero[n, k // group]) * scale[n, k // group], q unsigned
  4-bit (AWQ, GPTQ; symmetric ones have zero 8).
- Mxfp4Weight: W[n, k] = e2m1(q[n, k]) * 2^(e[n, k // 32] - 127) (OCP MXFP4, gpt-oss).

Int4 packs two values per byte along K: byte j of a row holds k = 2j in its low nibble
and k = 2j + 1 in its high one. MXFP4 keeps those bytes' values in each aligned 4-byte
word (k = 8w .. 8w + 7) but its codes' bits in the order its decode wants
(formats/e2m1_words.py); loading converts.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

MXFP4_BLOCK = 32  # K values per e8m0 scale


class QuantizedWeight(nn.Module):
    """A weight of logical shape [..., N, K] that computes in `dtype`."""

    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        *lead, n, k_stored = self.data.shape
        return torch.Size((*lead, n, k_stored * self.values_per_element))

    values_per_element = 1

    @property
    def device(self) -> torch.device:
        return self.data.device

    def rows(self, rows: slice) -> dict[str, torch.Tensor]:
        """Views of every buffer at output rows `rows` (of the last-but-one dim): where a
        fused layer's slice is loaded."""
        return {name: t[..., rows, :] for name, t in self.named_buffers(recurse=False)}

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.buffers(recurse=False))


class Fp8Weight(QuantizedWeight):
    """act_block: 0, activations stay in `dtype` (weight-only: ops read dequantize(W));
    else W8A8: activations quantized at run time to e4m3 per token and act_block
    columns (ops/reference/quant.quantize_activations); act_block is then block_k, a
    power of two of at least 32 (a K step of the kernels lies in one block of both).
    act_min_tokens: W8A8 only in GEMMs of at least this many rows (tokens), weight-only
    in smaller ones (ops/reference/quant.w8a8 decides)."""

    def __init__(self, shape: tuple[int, ...], block_k: int, dtype: torch.dtype, device=None,
                 act_block: int = 0, act_min_tokens: int = 0):
        super().__init__()
        *lead, n, k = shape
        self.block_k, self.dtype, self.act_block = block_k, dtype, act_block
        self.act_min_tokens = act_min_tokens
        self.register_buffer("data", torch.empty(shape, dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("scale", torch.empty(*lead, n, -(-k // block_k), dtype=torch.float32,
                                                  device=device))


class Fp8Rows(NamedTuple):
    """Activations x [T, K] as a W8A8 Fp8Weight of act_block `block` reads them:
    quantize_activations(x, block) (ops/reference/quant.py): q [T, K] e4m3 and scale
    [T, ceil(K / block)] float32. Written by the op that writes x (ops.rms_norm's
    fp8_block) and passed beside x, so the GEMMs reading x do not quantize it again."""

    q: torch.Tensor
    scale: torch.Tensor

    @staticmethod
    def empty(rows: int, k: int, block: int, device) -> Fp8Rows:
        """Uninitialised rows of [rows, k] activations, for a kernel to write."""
        return Fp8Rows(torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=device),
                       torch.empty(rows, -(-k // block), dtype=torch.float32, device=device))

    def check(self, x: torch.Tensor, block: int) -> None:
        """These are rows of x [T, K] in blocks of `block` (shapes)."""
        assert self.q.shape == x.shape and self.scale.shape == (x.shape[0], -(-x.shape[1] // block)), (
            x.shape, self.q.shape, self.scale.shape, block)


class Int4Weight(QuantizedWeight):
    """`scale` and `zero` [..., N, K / G] are views of one tensor of (scale, zero) pairs
    (paired_scales): a group's two values are one 4-byte load, which the GEMM's
    pipeline copies ahead of each K step (2-byte loads stay out of it). Module moves
    (`.to`) copy the views apart: _apply pairs them again."""

    values_per_element = 2

    def __init__(self, shape: tuple[int, ...], group: int, dtype: torch.dtype, device=None):
        super().__init__()
        *lead, n, k = shape
        assert k % group == 0 and group % 2 == 0, (shape, group)
        self.group, self.dtype = group, dtype
        self.register_buffer("data", torch.empty(*lead, n, k // 2, dtype=torch.uint8, device=device))
        pairs = torch.empty(*lead, n, k // group, 2, dtype=dtype, device=device)
        self.register_buffer("scale", pairs[..., 0])
        self.register_buffer("zero", pairs[..., 1])
        self._integer_zeros: tuple | None = None  # ((zero's storage, version), the answer)

    def paired_scales(self) -> bool:
        """Whether each zero is stored right after its scale (as __init__ makes them)."""
        s, z = self.scale, self.zero
        return (s.stride() == z.stride() and s.dim() > 0 and s.stride(-1) == 2 and s.dtype == z.dtype
                and z.data_ptr() == s.data_ptr() + s.element_size())

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if not self.paired_scales():
            pairs = torch.stack((self.scale, self.zero), dim=-1)
            self.scale, self.zero = pairs[..., 0], pairs[..., 1]
        return self

    def integer_zeros(self) -> bool | None:
        """Whether every zero point is an integer in 0..127 (AWQ's and GPTQ's are 0..16):
        then q - zero is exact in bf16 and kernels may dequantize in bf16x2 arithmetic.
        Computed once per change of `zero`; None while a CUDA graph is being captured and
        it is not known (reading it back would break the capture)."""
        version = (self.zero.data_ptr(), self.zero._version)
        if self._integer_zeros is None or self._integer_zeros[0] != version:
            if self.zero.is_cuda and torch.cuda.is_current_stream_capturing():
                return None
            z = self.zero.float()
            exact = bool(((z == z.round()) & (z >= 0) & (z <= 127)).all())
            self._integer_zeros = (version, exact)
        return self._integer_zeros[1]


class Mxfp4Weight(QuantizedWeight):
    """`data` [..., N, K / 2]: e2m1 codes, 8 to a 4-byte word (formats/e2m1_words.py).
    `scale` [..., N, K / 32] is a view of rows stored SCALE_ROW_ALIGN-aligned, the
    padding 127 (a scale of 1): kernels whose K steps run past K read the padding
    (padded_scales), not a mask per scale, so a step's scales of a row are one aligned
    vector load (quant_tiles.mxfp4_scales says why that matters). A copy made
    contiguous (`.to`, `.contiguous`) loses the padding and is read the masked way."""

    values_per_element = 2
    SCALE_ROW_ALIGN = 16

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device=None):
        super().__init__()
        *lead, n, k = shape
        assert k % MXFP4_BLOCK == 0, shape
        self.dtype = dtype
        self.register_buffer("data", torch.empty(*lead, n, k // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scale", self._padded_rows((*lead, n, k // MXFP4_BLOCK), device))
        self._max_scale: tuple | None = None  # ((scale's storage, version), its largest value)

    @classmethod
    def _padded_rows(cls, shape: tuple[int, ...], device) -> torch.Tensor:
        """An e8m0 tensor of `shape`, a view of rows padded to SCALE_ROW_ALIGN with 127."""
        *lead, groups = shape
        stored = -(-groups // cls.SCALE_ROW_ALIGN) * cls.SCALE_ROW_ALIGN
        return torch.full((*lead, stored), 127, dtype=torch.uint8, device=device)[..., :groups]

    def _apply(self, fn, recurse=True):
        """Module moves (`.to(device)`) copy a strided view as a contiguous tensor: pad
        the scale rows again."""
        super()._apply(fn, recurse)
        if not self.padded_scales(self.scale.shape[-1]):
            padded = self._padded_rows(tuple(self.scale.shape), self.scale.device)
            self.scale = padded.copy_(self.scale)
        return self

    def padded_scales(self, groups: int) -> bool:
        """Whether every row's scales may be read as `groups` values (a kernel's whole K
        steps): rows SCALE_ROW_ALIGN-aligned and at least that long in storage (past K,
        padding, or the scales of the rest of K where this is a slice along K: finite
        either way, and met by masked-out values), the last row's inside the storage."""
        s = self.scale
        if s.dim() < 2 or s.stride(-1) != 1 or s.stride(-2) < groups or s.stride(-2) % self.SCALE_ROW_ALIGN:
            return False
        last = s.storage_offset() + sum((d - 1) * st for d, st in zip(s.shape[:-1], s.stride()[:-1]))
        return s.numel() > 0 and last + groups <= s.untyped_storage().nbytes()

    def max_scale(self) -> int | None:
        """The largest e8m0 scale (kernels pick their decoding by it), computed once per
        change of `scale`; None while a CUDA graph is being captured and it is not known
        (reading it back would break the capture)."""
        version = (self.scale.data_ptr(), self.scale._version)
        if self._max_scale is None or self._max_scale[0] != version:
            if self.scale.is_cuda and torch.cuda.is_current_stream_capturing():
                return None
            self._max_scale = (version, int(self.scale.max()) if self.scale.numel() else 0)
        return self._max_scale[1]
