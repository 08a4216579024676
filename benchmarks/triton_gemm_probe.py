"""Prefill-step GEMMs (Llama-3.1-8B projections, M = 1,488 / 2,048 tokens): does a Triton
GEMM beat cuBLAS's ~640-660 TFLOP/s on them?

    python benchmarks/triton_gemm_probe.py

y[M, N] = x[M, K] @ W[N, K]^T, bf16 in, float32 accumulate. Variants: tiles loaded
through pointers, and through TMA tensor descriptors (persistent: one program per SM
walking output tiles). Each case: 32 layers' distinct weights in one CUDA graph.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl
from gemm_probe import SHAPES, timed
from triton.tools.tensor_descriptor import TensorDescriptor

LAYERS = 8


@triton.jit
def _tile(t, num_m, num_n, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M row tiles share each column tile while it is in L2."""
    per_group = GROUP_M * num_n
    group = t // per_group
    first_m = group * GROUP_M
    size = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (t % per_group) % size, (t % per_group) // size


@triton.jit
def _gemm_ptr(x_ptr, w_ptr, y_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = _tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * K + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None] * K + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K // BLOCK_K):
        x = tl.load(x_ptrs, mask=offs_m[:, None] < M, other=0.0)
        w = tl.load(w_ptrs)
        acc = tl.dot(x, w.T, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(tl.bfloat16), mask=offs_m[:, None] < M)


@triton.jit
def _gemm_tma(x_desc, w_desc, y_desc, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr):
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    for t in tl.range(tl.program_id(0), num_m * num_n, NUM_SMS, flatten=True):
        pid_m, pid_n = _tile(t, num_m, num_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K // BLOCK_K):
            x = x_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
            w = w_desc.load([pid_n * BLOCK_N, k * BLOCK_K])
            acc = tl.dot(x, w.T, acc)
        y_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(tl.bfloat16))


def main():
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    weights = {name: [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(LAYERS)]
               for name, (n, k) in SHAPES.items()}
    configs = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s)
               for bm, bn, bk, w, s in itertools.product((128,), (128, 256), (64,), (8,), (3, 4))]
    configs += [dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_warps=4, num_stages=4),
                dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)]
    torch.backends.cuda.preferred_blas_library("cublaslt")
    for m in (1488, 2048):
        for name, (n, k) in SHAPES.items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            ws = weights[name]
            ref = x.float() @ ws[0].float().T
            flop = 2 * m * n * k

            def tf(fn):
                us = timed(fn) * 1e3 / LAYERS
                return flop / us / 1e6

            line = [f"M={m} {name:8s} cublasLt {tf(lambda: [torch.mm(x, w.T, out=y) for w in ws]):4.0f}"]
            best = {}
            for cfg in configs:
                bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
                launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
                grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)

                def ptr(w):
                    _gemm_ptr[grid](x, w, y, m, n, k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, **launch)

                xd = TensorDescriptor.from_tensor(x, [bm, bk])
                yd = TensorDescriptor.from_tensor(y, [bm, bn])
                wds = [TensorDescriptor.from_tensor(w, [bn, bk]) for w in ws]
                tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)

                def tma(wd):
                    _gemm_tma[(min(sms, tiles),)](xd, wd, yd, m, n, k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                                  GROUP_M=8, NUM_SMS=min(sms, tiles), **launch)

                for label, one, args in (("ptr", ptr, ws), ("tma", tma, wds)):
                    try:
                        y.fill_(float("nan"))
                        one(args[0])
                        err = ((y.float() - ref).norm() / ref.norm()).item()
                        if not err < 1e-2:
                            print(name, label, cfg, "WRONG", err)
                            continue
                        rate = tf(lambda one=one, args=args: [one(a) for a in args])
                    except Exception as exc:
                        print(name, label, cfg, type(exc).__name__, str(exc)[:120])
                        continue
                    if rate > best.get(label, (0,))[0]:
                        best[label] = (rate, cfg)
            for label, (rate, cfg) in best.items():
                line.append(f"{label} {rate:4.0f} ({cfg['BLOCK_M']}x{cfg['BLOCK_N']} w{cfg['num_warps']} "
                            f"s{cfg['num_stages']})")
            print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main()
