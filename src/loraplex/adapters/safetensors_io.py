"""Read a .safetensors file into one (page-locked) buffer and view its tensors in place.

An adapter load is then one read into memory a GPU copy can start from, with no copy per
tensor. The views are made only when asked for (`TensorFile`): a loader thread checks
names, shapes and bytes from the header and the buffer, and a GPU copy needs only byte
offsets. Each view is a few torch calls, and each torch call on a worker thread hands
the GIL back and forth with the engine thread, whose every kernel launch then waits for
it: hundreds per adapter slowed the engine's eager steps several times over while
adapters loaded. Corrupt files (short, bad header, offsets out of range, unknown
dtypes) raise ValueError.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from typing import NamedTuple

import numpy as np
import torch

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


class Entry(NamedTuple):
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # byte offsets in the buffer
    end: int


class TensorFile(Mapping[str, torch.Tensor]):
    """A safetensors file read whole into `buffer`: its tensors by name, each a view of
    the buffer made on first access; `entries` describe them without making any."""

    def __init__(self, buffer: torch.Tensor, entries: dict[str, Entry]):
        self.buffer, self.entries = buffer, entries
        self._views: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        view = self._views.get(name)
        if view is None:
            e = self.entries[name]
            raw = self.buffer[e.begin : e.end]
            if e.begin % e.dtype.itemsize:  # misaligned for a view: copy this one
                raw = raw.clone()
            view = self._views[name] = raw.view(e.dtype).view(e.shape)
        return view

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def bytes(self, begin: int, end: int) -> np.ndarray:
        """buffer[begin:end] as a NumPy array (no torch call)."""
        if not hasattr(self, "_np"):
            self._np = self.buffer.numpy()
        return self._np[begin:end]


def tensor_meta(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """dtype and shape by name (from the header for a TensorFile: no views made)."""
    if isinstance(tensors, TensorFile):
        return {n: (e.dtype, e.shape) for n, e in tensors.entries.items()}
    return {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()}


def memory_span(start: int, end: int) -> memoryview:
    """The bytes at addresses [start, end) (of tensors known to live there), no copy."""
    import ctypes

    return memoryview((ctypes.c_ubyte * (end - start)).from_address(start)).cast("B")


# Read adapter files with O_DIRECT into page-aligned buffers: the disk DMAs into the
# page-locked buffer, and no CPU copies the bytes out of the page cache (an experiment:
# copies by loader threads slow the engine thread, see benchmarks/NOTES.md).
DIRECT_READS = os.environ.get("LORAPLEX_DIRECT_READS", "0") == "1"
_PAGE = 4096
_DIRECT_CHUNK = 16 << 20


def _read_direct(path: str, into: torch.Tensor, size: int) -> bool:
    """Read the file into `into` with O_DIRECT; False (nothing done) where that is not
    possible (unaligned buffer, too small for whole pages, no O_DIRECT here)."""
    padded = -(-size // _PAGE) * _PAGE
    if not hasattr(os, "O_DIRECT") or into.data_ptr() % _PAGE or into.numel() < padded:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    try:
        view = memoryview(into.numpy())
        done = 0
        while done < size:
            n = os.preadv(fd, [view[done : min(done + _DIRECT_CHUNK, padded)]], done)
            if n <= 0:
                raise ValueError(f"file shrank while reading ({done} of {size} bytes)")
            done += n
        return True
    except OSError:  # e.g. EINVAL: the file system refuses O_DIRECT after all
        return False
    finally:
        os.close(fd)


def read_safetensors(path: str, pinned: bool, into: torch.Tensor | None = None) -> TensorFile:
    """`into`: a uint8 buffer to read into if the file fits (else one is allocated)."""
    size = os.path.getsize(path)
    if size < 8:
        raise ValueError(f"{size} bytes is too short for a safetensors file")
    if into is not None and into.numel() >= size:
        buf = into[:size]
    else:
        buf = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
    view = memoryview(buf.numpy())
    if not (DIRECT_READS and into is not None and _read_direct(path, into, size)):
        with open(path, "rb", buffering=0) as f:
            done = 0
            while done < size:
                n = f.readinto(view[done:])
                if not n:
                    raise ValueError(f"file shrank while reading ({done} of {size} bytes)")
                done += n
    header_len = int.from_bytes(view[:8], "little")
    if not 0 < header_len <= size - 8:
        raise ValueError(f"header length {header_len} does not fit a {size}-byte file")
    try:
        header = json.loads(bytes(view[8 : 8 + header_len]))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"header is not JSON: {e}") from None
    base, data_len = 8 + header_len, size - 8 - header_len
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"tensor {name!r} has a malformed header entry") from None
        numel = 1
        for d in shape:
            numel *= d
        if not 0 <= begin <= end <= data_len or end - begin != numel * dtype.itemsize:
            raise ValueError(f"tensor {name!r}: offsets {begin}..{end} do not fit its shape or the file")
        entries[name] = Entry(dtype, shape, base + begin, base + end)
    return TensorFile(buf, entries)
