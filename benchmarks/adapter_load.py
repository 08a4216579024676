"""Adapter loads from local disk into pinned host memory, with no engine running.

    python -m benchmarks.adapter_load DIR [DIR ...] [--threads 1 4 8 16]
    python -m benchmarks.adapter_load --generate 96      # random Llama-3.1-8B adapters

Times each phase of one load on one thread (read the file into a pinned buffer, content
id, validate + fold scaling; medians over the first 20 adapters), then loads per second
with N threads over all of them. DIRs are PEFT adapter directories of one model;
--generate writes N random rank-16 adapters on every projection of --model (84 MB each
for Llama-3.1-8B) into --cache-dir first, as `loraplex bench` does. Compare with the load
times `loraplex bench --cold-adapters` reports while serving to see how much is
contention with the engine loop.

Figure: benchmarks/RESULTS.md, "Adapter loads".
"""

from __future__ import annotations

import statistics
import time

from benchmarks import harness


def projections_of(adapter_dir: str) -> dict[str, tuple[int, int]]:
    """module -> (in, out) of every LoRA pair in a PEFT adapter file."""
    from safetensors import safe_open

    out = {}
    with safe_open(f"{adapter_dir}/adapter_model.safetensors", "pt") as f:
        for key in f.keys():
            if key.endswith("lora_A.weight"):
                module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                a = f.get_slice(key).get_shape()
                b = f.get_slice(key.replace("lora_A", "lora_B")).get_shape()
                out[module] = (a[1], b[0])
    return out


def build_parser():
    p = harness.parser(__doc__)
    p.add_argument("dirs", nargs="*", help="PEFT adapter directories")
    p.add_argument("--generate", type=int, default=0, metavar="N",
                   help="load N random adapters of --model, written into --cache-dir if missing")
    p.add_argument("--model", default="llama-3.1-8b",
                   help="--generate's bundled config (default: %(default)s)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 4, 8, 16])
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    import torch

    # Engine internals: the loader's phases, called one by one.
    from loraplex.adapters.manifest import content_id
    from loraplex.adapters.peft import read_adapter_dir, to_canonical
    from loraplex.adapters.pinned_pool import PinnedPool
    from loraplex.bench.workload import prepare_adapters

    dirs = [str(d) for d in args.dirs]
    if args.generate:
        paths = prepare_adapters(args.cache_dir, args.model, harness.model_shape(args.model).modules(),
                                 list(range(args.generate)), 16)
        dirs += [str(p) for p in paths.values()]
    if not dirs:
        raise SystemExit("no adapters: give DIRs or --generate N")
    proj = projections_of(dirs[0])
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
    for d in dirs[:20]:
        load(d, phases)
    results = {"adapters": len(dirs), "phase_ms": {}, "loads_per_s": {}}
    for name, i in [("read", 0), ("content id", 1), ("validate+scale", 2)]:
        results["phase_ms"][name] = statistics.median(p[i] for p in phases) * 1e3
        print(f"{name:15s} median {results['phase_ms'][name]:7.1f} ms")
    from concurrent.futures import ThreadPoolExecutor

    for n in args.threads:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(n) as ex:
            list(ex.map(load, dirs))
        results["loads_per_s"][n] = len(dirs) / (time.perf_counter() - t0)
        print(f"{n} threads: {results['loads_per_s'][n]:6.1f} loads/s")
    harness.write_json(args.out, results, args)


if __name__ == "__main__":
    main()
