"""The order of MXFP4's e2m1 codes in Mxfp4Weight.data: "e2m1 words".

Checkpoints (OCP MXFP4, gpt-oss) pack two codes a byte, k = 2j in byte j's low nibble
and k = 2j + 1 in its high one. Mxfp4Weight keeps the same bytes a row and the same 8
values (k = 8w .. 8w + 7) in each aligned 4-byte word w, but places each code's four
bits (sign, e1, e0, m) where the decode in front of the MMA wants them: an e2m1 code
put at bf16 bits 15 | 8 7 | 6 reads as its value times 2^-126, so a bf16x2 holding two
of them needs only a multiply by the scale. The positions below put k = 0 and 2 there
as they are, k = 4, 6 and k = 1, 3 after a rotation by 3 and 6, and k = 5, 7 after one
multiply (quant_tiles.e2m1_word_bits and _E2M1_WORD_ASM: 1.5 instructions a value on sm_90,
against 2.25 for nibbles; benchmarks/RESULTS.md, "e2m1 words"). The bytes are
little-endian words, as GPUs and x86 read them.

Loading converts a checkpoint's bytes (`from_nibbles_`), quantize_mxfp4 writes words,
and ops.reference.quant.dequantize reads them back (`to_nibbles`): every kernel's oracle.
"""

from __future__ import annotations

import torch

# k offset in the word -> bit of its (m, e0, e1, sign) (code bits 0, 1, 2, 3).
WORD_BITS = {
    0: (6, 7, 8, 15), 2: (22, 23, 24, 31),  # as they are
    4: (9, 10, 11, 18), 6: (25, 26, 27, 2),  # rotated right by 3
    1: (12, 13, 14, 21), 3: (28, 29, 30, 5),  # by 6
    5: (3, 4, 0, 1), 7: (19, 20, 16, 17),  # x 0x4108 (bits 0, 1, 3, 4 of each half)
}
_CHUNK_WORDS = 1 << 22  # words converted at once (int64 temporaries of 32 MiB)


def _moves(to_words: bool) -> list[tuple[int, int]]:
    """(shift left, source mask) pairs moving every bit of a nibble-ordered word (value
    k in bits 4k .. 4k + 3) to its place in an e2m1 word, or back."""
    by_shift: dict[int, int] = {}
    for k, bits in WORD_BITS.items():
        for b, dst in enumerate(bits):
            src = 4 * k + b
            src, dst = (src, dst) if to_words else (dst, src)
            by_shift[dst - src] = by_shift.get(dst - src, 0) | (1 << src)
    return sorted(by_shift.items())


_TO_WORDS, _TO_NIBBLES = _moves(True), _moves(False)


def _permute(data: torch.Tensor, moves: list[tuple[int, int]]) -> torch.Tensor:
    """uint8 [..., K / 2] (K / 2 a multiple of 4, the last dim contiguous) -> a new
    contiguous uint8 tensor of the same shape, each 4-byte word's bits moved."""
    assert data.dtype == torch.uint8 and data.shape[-1] % 4 == 0, (data.dtype, data.shape)
    words = data.contiguous().view(torch.int32).reshape(-1)
    out = torch.empty_like(words)
    for start in range(0, words.numel(), _CHUNK_WORDS):
        w = words[start:start + _CHUNK_WORDS].to(torch.int64) & 0xFFFFFFFF
        moved = torch.zeros_like(w)
        for shift, mask in moves:
            moved |= (w & mask) << shift if shift >= 0 else (w & mask) >> -shift
        signed = torch.where(moved >= 1 << 31, moved - (1 << 32), moved)
        out[start:start + _CHUNK_WORDS] = signed.to(torch.int32)
    return out.view(torch.uint8).reshape(data.shape)


def from_nibbles_(data: torch.Tensor) -> torch.Tensor:
    """Rewrite checkpoint-ordered bytes (two codes a byte, low nibble first) in place as
    e2m1 words; returns data."""
    return data.copy_(_permute(data, _TO_WORDS))


def to_nibbles(data: torch.Tensor) -> torch.Tensor:
    """e2m1 words -> the checkpoint's bytes (a new tensor)."""
    return _permute(data, _TO_NIBBLES)
