"""What a fork to a side stream costs the decode GEMMs in a CUDA graph.

    python benchmarks/gemm_stream_probe.py

Decode graphs with adapters fork each projection's LoRA shrink onto a side stream beside
its base GEMM. This captures 32 layers of Llama-3.1-8B's four projections at M = 32
tokens in one CUDA graph, with and without a fork and join around each GEMM (with no work
on the side, and with one small kernel), and prints each variant's time per layer and the
cuBLASLt kernels it ran (whether the fork changes cuBLASLt's choice).
"""

from __future__ import annotations

import collections

import torch
import torch.nn.functional as F
import triton
from gemm_probe import LAYERS, SHAPES
from torch.profiler import ProfilerActivity, profile


def layer_chain(xs, ws, aux, side_work):
    outs = []
    for name, w in ws.items():
        x = xs[name]
        if aux is not None:
            main = torch.cuda.current_stream()
            aux.wait_stream(main)
            with torch.cuda.stream(aux):
                if side_work:
                    outs.append(x[:, :16].float().sum())  # a small kernel, as the shrink is
            outs.append(F.linear(x, w))
            main.wait_stream(aux)
        else:
            outs.append(F.linear(x, w))
    return outs


def main():
    torch.backends.cuda.preferred_blas_library("cublaslt")
    torch.manual_seed(0)
    layers = [{name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
               for name, (n, k) in SHAPES.items()} for _ in range(LAYERS)]
    xs = {name: torch.randn(32, k, device="cuda", dtype=torch.bfloat16) for name, (_, k) in SHAPES.items()}
    aux = torch.cuda.Stream()
    variants = {"no side stream": (None, False), "fork + join only": (aux, False),
                "fork + small kernel on the side": (aux, True)}
    for label, (stream, work) in variants.items():
        def run():
            for ws in layers:
                layer_chain(xs, ws, stream, work)
        run()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        ms = triton.testing.do_bench(g.replay, rep=300, return_mode="median")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            g.replay()
            torch.cuda.synchronize()
        kernels = collections.Counter()
        for e in prof.key_averages():
            if "nvjet" in e.key or "gemm" in e.key.lower() or "splitK" in e.key:
                kernels[e.key[:60]] = round(e.self_device_time_total / e.count, 1)
        print(f"{label:34s} {ms * 1e3 / LAYERS:6.1f} us per layer  {dict(kernels)}", flush=True)


if __name__ == "__main__":
    main()
