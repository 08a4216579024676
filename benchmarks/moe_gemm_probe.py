"""The MoE grouped GEMMs of a decode step: weight tiles by pointer loads or by TMA, the
tuned config and a sweep of TMA configs, us per layer (6 layers of distinct weights in
one CUDA graph, so weights come from HBM) and the bandwidth of the touched experts.

    python benchmarks/moe_gemm_probe.py [--tokens 16 64] [--out probe.json]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton

from loraplex import ops
from loraplex.ops.triton import moe_gemm
from loraplex.ops.triton.moe_align import align_experts

MOE = {"qwen3-30b-a3b": (128, 2048, 768, 8), "gpt-oss-20b": (32, 2880, 2880, 4)}
ROWS = []


def timed(label, fn, per, bytes_per=None):
    try:
        fn()
        torch.cuda.synchronize()
        us = triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median") * 1e3 / per
    except Exception as exc:  # a config that does not compile (shared memory, TMA box)
        print(f"{label:64s} {type(exc).__name__}: {str(exc)[:80]}")
        return float("inf")
    tbs = f"{bytes_per / us / 1e6:5.2f} TB/s" if bytes_per else ""
    ROWS.append(dict(case=label, us=us))
    print(f"{label:64s} {us:8.2f} us {tbs}", flush=True)
    return us


def probe(name, e, h, i, k, t, layers=6):
    dev, dt = "cuda", torch.bfloat16
    gen = torch.Generator(dev).manual_seed(0)
    w_gu = [(torch.randn(e, 2 * i, h, device=dev, generator=gen) * 0.02).to(dt) for _ in range(layers)]
    w_d = [(torch.randn(e, h, i, device=dev, generator=gen) * 0.02).to(dt) for _ in range(layers)]
    x = torch.randn(t, h, device=dev, generator=gen).to(dt)
    weights, ids = ops.route_experts(torch.randn(t, e, device=dev, generator=gen), k, True)
    hit = ids.unique().numel()
    p = t * k
    act = torch.empty(p, i, device=dev, dtype=dt)
    y = torch.empty(p, h, device=dev, dtype=dt)
    tuned_gu, tuned_d = moe_gemm.gemm_config(w_gu[0], t, k), moe_gemm.gemm_config(w_d[0], t, k)
    aligns = {bm: align_experts(ids, e, bm) for bm in (16, 32)}

    def gate_up(cfg):
        return lambda: [moe_gemm.moe_gemm(x, w, None, act, aligns[cfg["BLOCK_M"]], cfg, k, "silu")
                        for w in w_gu]

    def down(cfg):
        return lambda: [moe_gemm.moe_gemm(act, w, None, y, aligns[cfg["BLOCK_M"]], cfg, 1,
                                          routed_weights=weights) for w in w_d]

    tag = f"{name} {t} tok ({hit} experts)"
    gu_bytes, d_bytes = hit * 2 * i * h * 2, hit * h * i * 2
    outs = {}
    for tma in (0, 1):
        cfg_gu, cfg_d = {**tuned_gu, "TMA": tma}, {**tuned_d, "TMA": tma}
        timed(f"{tag} gate_up tuned, tma {tma}", gate_up(cfg_gu), layers, gu_bytes)
        timed(f"{tag} down tuned, tma {tma}", down(cfg_d), layers, d_bytes)
        gate_up(cfg_gu)()
        down(cfg_d)()
        outs[tma] = (act.clone(), y.clone())
    for a, b in zip(outs[0], outs[1]):
        print(f"  tma vs pointer loads: max |diff| {(a.float() - b.float()).abs().max().item():.2e}")
    for bn, bk, warps, stages in itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (3, 4)):
        cfg = dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, num_warps=warps, num_stages=stages, TMA=1)
        if stages * (16 * bk + 2 * bk * bn) * 2 > 200 * 1024:
            continue
        c = f"BN {bn} BK {bk} w {warps} st {stages}"
        timed(f"{tag} gate_up tma {c}", gate_up(cfg), layers, gu_bytes)
        timed(f"{tag} down tma {c}", down(cfg), layers, d_bytes)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[16])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    for t in args.tokens:
        for name, shape in MOE.items():
            probe(name, *shape, t)
            torch.cuda.empty_cache()
    best = {}
    for r in ROWS:
        key = r["case"].split(" tma ")[0].replace(" tuned,", "")
        if r["case"].split(" tma ")[-1][:2] in ("BN",) and r["us"] < best.get(key, (float("inf"),))[0]:
            best[key] = (r["us"], r["case"])
    print("\nbest TMA config per GEMM:")
    for us, case in best.values():
        print(f"  {case:72s} {us:8.2f} us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(ROWS, f, indent=1)


if __name__ == "__main__":
    main()
