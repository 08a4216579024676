"""Read a .safetensors file into one (page-locked) buffer and view its tensors in place.

An adapter load is then one read into memory a GPU copy can start from, with no copy per
tensor. The views are made only when asked for (`TensorFile`): a loader thread checks
names, shapes and bytes from the header and the buffer, and a GPU copy needs only byte
offsets. Each view is a few torch calls, and each torch call on a worker thread hands
the GIL back and forth with the engine thread, whose every kernel launch then waits for
it: hundreds per adapter slowed the engine's eager steps several times over while
adapters loaded. The header is read and checked before the data (a corrupt or oversized
file is refused without reading it): corrupt files (short, bad header, tensors that do not
tile the data exactly, unknown dtypes) raise ValueError, files past the caller's limits
TooLarge.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from typing import NamedTuple

import numpy as np
import torch

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}
MAX_HEADER = 100_000_000  # bytes of JSON header, as the safetensors library bounds it


class TooLarge(ValueError):
    """The file holds more than the caller's limits allow (found before reading its data)."""


class Limits(NamedTuple):
    """The most a file may hold: tensor values (of any dtype) and header bytes."""

    values: int
    header: int = MAX_HEADER

    @property
    def file_bytes(self) -> int:
        """The largest file within these limits (every value float64, the widest dtype)."""
        return 8 + self.header + 8 * self.values


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
# copies by loader threads slow the engine thread, see benchmarks/LOG.md).
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


def read_safetensors(path: str, pinned: bool, into: torch.Tensor | None = None,
                     limits: Limits | None = None) -> TensorFile:
    """`into`: a uint8 buffer to read into if the file fits (else one is allocated).
    The header is read and checked first, and the file against `limits`: a corrupt or
    oversized file costs a header read, never a read of its data."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise ValueError(f"{size} bytes is too short for a safetensors file")
        head = bytearray(8)
        _read_into(f, memoryview(head), 0, 8)
        header_len = int.from_bytes(head, "little")
        if not 0 < header_len <= size - 8:
            raise ValueError(f"header length {header_len} does not fit a {size}-byte file")
        max_header = limits.header if limits is not None else MAX_HEADER
        if header_len > max_header:
            raise TooLarge(f"has a header of {header_len} bytes (at most {max_header})")
        header = bytearray(header_len)
        _read_into(f, memoryview(header), 0, header_len)
        base = 8 + header_len
        entries, values = _entries(header, base, size - base)
        if limits is not None and values > limits.values:
            raise TooLarge(f"holds {values} values (at most {limits.values})")
        if into is not None and into.numel() >= size:
            buf = into[:size]
        else:
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        if not (DIRECT_READS and into is not None and _read_direct(path, into, size)):
            view = memoryview(buf.numpy())
            view[:8], view[8:base] = head, header  # the header as checked, then the data in one read
            _read_into(f, view, base, size)
    return TensorFile(buf, entries)


def _read_into(f, view: memoryview, done: int, size: int) -> None:
    while done < size:
        n = f.readinto(view[done:size])
        if not n:
            raise ValueError(f"file shrank while reading ({done} of {size} bytes)")
        done += n


def _entries(header: bytes, base: int, data_len: int) -> tuple[dict[str, Entry], int]:
    """The header's tensors (offsets from the file's start) and their number of values.
    The tensors must tile the data section exactly: no byte read as two tensors, none
    unread (as the safetensors library requires)."""
    try:
        parsed = json.loads(header)
    except RecursionError:
        raise ValueError("header is not JSON: nested too deeply") from None
    except ValueError as e:  # (bad UTF-8 and Python's digit limit are ValueErrors too)
        raise ValueError(f"header is not JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise ValueError("header is not a JSON object")
    entries, spans, values = {}, [], 0
    for name, info in parsed.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(info["shape"])
            begin, end = info["data_offsets"]
            ok = all(type(x) is int and x >= 0 for x in (*shape, begin, end))  # (not bool, not 2.0)
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"tensor {name[:200]!r} has a malformed header entry")
        numel = _numel(shape, data_len)
        if end - begin != numel * dtype.itemsize:
            raise ValueError(f"tensor {name[:200]!r}: offsets {begin}..{end} do not fit its shape")
        entries[name] = Entry(dtype, shape, base + begin, base + end)
        spans.append((begin, end, name))
        values += numel
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            raise ValueError(f"tensor {name[:200]!r} begins at byte {begin} of the data, not {at}: "
                             "tensors overlap or leave gaps")
        at = end
    if at != data_len:
        raise ValueError(f"the tensors end at byte {at} of a {data_len}-byte data section")
    return entries, values


def _numel(shape: tuple[int, ...], cap: int) -> int:
    """math.prod(shape), stopped once past `cap` (millions of huge dims multiplied out
    would take minutes; such a tensor fits no file anyway)."""
    if 0 in shape:
        return 0
    numel = 1
    for d in shape:
        numel *= d
        if numel > cap:
            break
    return numel
