"""How much do adapter loads on worker threads slow the engine thread's kernel launches?

The engine thread runs a host-bound imitation of an eager step (as many small CUDA ops
as a Llama-8B prefill step with LoRA launches: ~900); N worker threads meanwhile repeat
one kind of work: `python` (pure Python, holds the GIL), `readinto` (adapter files into
page-locked buffers: memory bandwidth, no GIL), `finite` (the finiteness check), `load`
(what a loader does per adapter: read, parse, validate). Prints the step time per (work,
N), so a slowdown can be pinned on the GIL, on memory bandwidth or on torch calls.

    python -m benchmarks.loader_interference [--threads 1 2 8] [--work load readinto]

Loader work reads 16 random rank-16 Llama-3.1-8B adapters (84 MB each), written into
--cache-dir once. Runs on a CPU too (the imitation then has no device to wait for).

Figure: benchmarks/RESULTS.md, "Loader threads beside the engine thread".
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from pathlib import Path

from benchmarks import harness


def fake_step(x, ws) -> None:
    """~900 small ops, as a Llama-8B prefill step's launches with LoRA: 4 per projection."""
    import torch.nn.functional as F

    for w in ws:
        y = F.linear(x, w)
        y = y.view(-1)[: x.numel()].view_as(x)
        x = x + y
    x.sum().item()  # waits for the device: the step's wall time


def worker(kind: str, files: list[Path], projections: dict, stop: threading.Event, done: list[int]) -> None:
    import torch

    # Engine internals: the loader's read, finiteness check and validation.
    from loraplex.adapters.peft import _all_finite, read_adapter_dir, to_canonical
    from loraplex.adapters.safetensors_io import read_safetensors

    pinned = torch.cuda.is_available()
    buf = torch.empty(max(f.stat().st_size for f in files) + 4096, dtype=torch.uint8, pin_memory=pinned)
    i = 0
    while not stop.is_set():
        f = files[i % len(files)]
        i += 1
        if kind == "python":
            sum(range(20000))
        elif kind == "readinto":
            read_safetensors(str(f), pinned, buf)
        elif kind == "finite":
            _all_finite([buf[: (buf.numel() // 2) * 2].view(torch.bfloat16)])
        elif kind == "load":
            config, tensors = read_adapter_dir("a", f.parent, pinned, buf)
            to_canonical("k", "a", str(f.parent), config, tensors, projections, 16, torch.bfloat16)
        done[0] += 1


def build_parser():
    p = harness.parser(__doc__)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--work", nargs="+", default=["readinto", "finite", "load"],
                   choices=["python", "readinto", "finite", "load"],
                   help="also: python (slow: the engine thread then gets ~1 op per switch interval)")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--switch-interval", type=float, nargs="+", default=None,
                   help="GIL switch intervals to try (s); default the engine's")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    import torch

    from loraplex.adapters.peft import WEIGHTS_FILE
    from loraplex.bench.workload import prepare_adapters
    from loraplex.engine.engine import SWITCH_INTERVAL_S

    intervals = args.switch_interval or [SWITCH_INTERVAL_S]
    projections = harness.model_shape("llama-3.1-8b").modules()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    paths = prepare_adapters(args.cache_dir, "llama-3.1-8b", projections, list(range(16)), 16)
    files = [path / WEIGHTS_FILE for path in paths.values()]
    x = torch.randn(16, 256, device=dev)
    ws = [torch.randn(256, 256, device=dev) for _ in projections]

    def timed() -> float:
        fake_step(x, ws)
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            fake_step(x, ws)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    alone = timed()
    print(f"step alone: {alone:.2f} ms")
    print("| switch interval ms | work | threads | step ms | x alone | worker items/s |")
    print("|---|---|---|---|---|---|")
    results = {"alone_ms": alone, "runs": []}
    runs = [(k, i, n) for k in args.work for i in intervals for n in args.threads]
    old_interval = sys.getswitchinterval()
    try:
        for kind, interval, n in runs:
            sys.setswitchinterval(interval)
            stop, done = threading.Event(), [0]
            threads = [threading.Thread(target=worker, args=(kind, files, projections, stop, done))
                       for _ in range(n)]
            for t in threads:
                t.start()
            time.sleep(0.3)
            t0, d0 = time.perf_counter(), done[0]
            ms = timed()
            rate = (done[0] - d0) / (time.perf_counter() - t0)
            stop.set()
            for t in threads:
                t.join()
            results["runs"].append(dict(switch_interval_s=interval, work=kind, threads=n, step_ms=ms,
                                        x_alone=ms / alone, items_per_s=rate))
            print(f"| {interval * 1e3:g} | {kind} | {n} | {ms:.2f} | {ms / alone:.1f} | {rate:.1f} |")
    finally:
        sys.setswitchinterval(old_interval)
    harness.write_json(args.out, results, args)


if __name__ == "__main__":
    main()
