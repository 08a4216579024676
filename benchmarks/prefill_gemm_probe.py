"""The projections' GEMMs at prefill-step sizes (Llama-3.1-8B): how close to the bf16
matmul ceiling does cuBLAS run them, token count by token count?

    python benchmarks/prefill_gemm_probe.py [--tokens 1024 1488 1536 2048]

A step with prefill tokens is compute-bound: its four GEMMs per layer are ~95% of its
FLOPs. Each case runs 32 layers' distinct weights in one CUDA graph; prints TFLOP/s per
projection and the layer total against the 790 TFLOP/s measured for large matmuls.
"""

from __future__ import annotations

import argparse

import torch
from gemm_probe import LAYERS, SHAPES, timed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 1472, 1488, 1536, 1600, 2048])
    args = ap.parse_args()
    torch.manual_seed(0)
    weights = {name: [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(LAYERS)]
               for name, (n, k) in SHAPES.items()}
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        for m in args.tokens:
            cells, total_us, total_flop = [], 0.0, 0
            for name, (n, k) in SHAPES.items():
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                ws = weights[name]
                us = timed(lambda: [torch.mm(x, w.T, out=y) for w in ws]) * 1e3 / LAYERS
                flop = 2 * m * n * k
                cells.append(f"{name} {us:6.1f} us {flop / us / 1e6:4.0f} TF")
                total_us += us
                total_flop += flop
            print(f"{lib:8s} M={m:5d}: layer {total_us:6.1f} us ({total_flop / total_us / 1e6:4.0f} TF/s, "
                  f"{total_us / m * 1e3:5.1f} ns/token)  " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
