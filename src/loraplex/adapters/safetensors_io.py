"""Read a .safetensors file into one (page-locked) buffer and view its tensors in place.

An adapter load is then one read into memory a GPU copy can start from, with no copy per
tensor: hundreds of small tensor operations would each re-take the GIL from a busy
engine thread, which made loads on worker threads take seconds. Corrupt files (short,
bad header, offsets out of range, unknown dtypes) raise ValueError.
"""

from __future__ import annotations

import json
import os

import torch

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


def read_safetensors(path: str, pinned: bool, into: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """`into`: a uint8 buffer to read into if the file fits (else one is allocated)."""
    size = os.path.getsize(path)
    if size < 8:
        raise ValueError(f"{size} bytes is too short for a safetensors file")
    if into is not None and into.numel() >= size:
        buf = into[:size]
    else:
        buf = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
    view = memoryview(buf.numpy())
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
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"tensor {name!r} has a malformed header entry") from None
        numel = 1
        for d in shape:
            numel *= d
        if not 0 <= begin <= end <= data_len or end - begin != numel * dtype.itemsize:
            raise ValueError(f"tensor {name!r}: offsets {begin}..{end} do not fit its shape or the file")
        raw = buf[base + begin : base + end]
        if (base + begin) % dtype.itemsize:  # misaligned for a view: copy this one
            raw = raw.clone()
        tensors[name] = raw.view(dtype).view(shape)
    return tensors
