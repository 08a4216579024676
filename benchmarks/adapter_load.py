"""Adapter loads from local disk into pinned host memory, with no engine running.

    python benchmarks/adapter_load.py DIR [DIR ...] [--threads 1 4 8]

Times each phase of one load (read the file into a pinned buffer, content id, validate
+ fold scaling) on one thread, then loads per second with N threads. Compare with the
load times `loraplex bench --cold-adapters` reports while serving to see how much is
contention with the engine loop.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from safetensors import safe_open

from loraplex.adapters.manifest import content_id
from loraplex.adapters.peft import read_adapter_dir, to_canonical
from loraplex.adapters.pinned_pool import PinnedPool


def projections_of(adapter_dir: str) -> dict[str, tuple[int, int]]:
    out = {}
    with safe_open(f"{adapter_dir}/adapter_model.safetensors", "pt") as f:
        for key in f.keys():
            if key.endswith("lora_A.weight"):
                module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                a = f.get_slice(key).get_shape()
                b = f.get_slice(key.replace("lora_A", "lora_B")).get_shape()
                out[module] = (a[1], b[0])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 4, 8])
    args = ap.parse_args()
    proj = projections_of(args.dirs[0])
    pinned = torch.cuda.is_available()
    nbytes = 16 * sum(i + o for i, o in proj.values()) * 2 + (1 << 20)
    pool = PinnedPool(max(args.threads) + 1, nbytes) if pinned else None

    def load(d, phases=None):
        slab = pool.take(nbytes - (1 << 20)) if pool else None
        t0 = time.perf_counter()
        config, tensors = read_adapter_dir("x", d, pinned, slab)
        t1 = time.perf_counter()
        cid = content_id(config, tensors)
        t2 = time.perf_counter()
        to_canonical(cid, "x", d, config, tensors, proj, 16, torch.bfloat16)
        t3 = time.perf_counter()
        if pool:
            pool.give(slab, None)
        if phases is not None:
            phases.append((t1 - t0, t2 - t1, t3 - t2))

    phases = []
    for d in args.dirs[:20]:
        load(d, phases)
    for name, i in [("read", 0), ("content id", 1), ("validate+scale", 2)]:
        print(f"{name:15s} median {statistics.median(p[i] for p in phases) * 1e3:7.1f} ms")
    for n in args.threads:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(n) as ex:
            list(ex.map(load, args.dirs))
        dt = time.perf_counter() - t0
        print(f"{n} threads: {len(args.dirs) / dt:6.1f} loads/s")


if __name__ == "__main__":
    main()
