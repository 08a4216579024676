"""How much do adapter loads on worker threads slow the engine thread's kernel launches?

The engine thread runs a host-bound imitation of an eager step (as many small CUDA ops
as a Llama-8B prefill step with LoRA launches: ~900); N worker threads meanwhile repeat
one kind of work: `python` (pure Python, holds the GIL), `readinto` (adapter files into
page-locked buffers: memory bandwidth, no GIL), `finite` (the finiteness check), `load`
(what a loader does per adapter: read, parse, validate). Prints the step time per (work,
N), so a slowdown can be pinned on the GIL, on memory bandwidth or on torch calls.

    python benchmarks/loader_interference.py [--threads 1 2 8] [--work load readinto]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from loraplex.adapters.peft import WEIGHTS_FILE, _all_finite, read_adapter_dir, to_canonical
from loraplex.adapters.safetensors_io import read_safetensors
from loraplex.bench.workload import prepare_adapters
from loraplex.engine.engine import SWITCH_INTERVAL_S

SHAPES = {"self_attn.q_proj": (4096, 4096), "self_attn.k_proj": (4096, 1024),
          "self_attn.v_proj": (4096, 1024), "self_attn.o_proj": (4096, 4096),
          "mlp.gate_proj": (4096, 14336), "mlp.up_proj": (4096, 14336), "mlp.down_proj": (14336, 4096)}
PROJECTIONS = {f"model.layers.{i}.{m}": s for i in range(32) for m, s in SHAPES.items()}


def fake_step(x: torch.Tensor, ws: list[torch.Tensor]) -> None:
    for w in ws:  # 4 ops per projection, 224 projections
        y = F.linear(x, w)
        y = y.view(-1)[: x.numel()].view_as(x)
        x = x + y
    x.sum().item()  # waits for the device: the step's wall time


def worker(kind: str, files: list[Path], stop: threading.Event, done: list[int]) -> None:
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
            to_canonical("k", "a", str(f.parent), config, tensors, PROJECTIONS, 16, torch.bfloat16)
        done[0] += 1


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--work", nargs="+", default=["readinto", "finite", "load"],
                   help="also: python (slow: the engine thread then gets ~1 op per switch interval)")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--switch-interval", type=float, nargs="+", default=[SWITCH_INTERVAL_S],
                   help="GIL switch intervals to try (s); default the engine's")
    p.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "lp-interference"))
    args = p.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    paths = prepare_adapters(Path(args.cache_dir), "llama-3.1-8b", PROJECTIONS, list(range(16)), 16)
    files = [path / WEIGHTS_FILE for path in paths.values()]
    x = torch.randn(16, 256, device=dev)
    ws = [torch.randn(256, 256, device=dev) for _ in PROJECTIONS]

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
    runs = [(k, i, n) for k in args.work for i in args.switch_interval for n in args.threads]
    for kind, interval, n in runs:
        sys.setswitchinterval(interval)
        stop, done = threading.Event(), [0]
        threads = [threading.Thread(target=worker, args=(kind, files, stop, done)) for _ in range(n)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        t0, d0 = time.perf_counter(), done[0]
        ms = timed()
        rate = (done[0] - d0) / (time.perf_counter() - t0)
        stop.set()
        for t in threads:
            t.join()
        print(f"| {interval * 1e3:g} | {kind} | {n} | {ms:.2f} | {ms / alone:.1f} | {rate:.1f} |")


if __name__ == "__main__":
    main()
