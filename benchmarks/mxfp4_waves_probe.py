"""Probe (one question, then removed): are gpt-oss-20b's MXFP4 decode GEMMs bound by
wave quantization, the last wave of equal-length programs leaving SMs idle? One
`moe_gemm_quant` at 16 tokens (top 4 of 32 experts), its tuned config, CUDA graphs:
(N, K) against (sN, K / s), the work a split of K in s would give each program (no
fix-up counted), and the time against the number of experts hit (routing restricted to
the first m experts). Answer: benchmarks/LOG.md, "The expert GEMMs' waves, probed".

    python benchmarks/mxfp4_waves_probe.py   (OUT=dir for waves.json)
"""
import json
import os

import torch

from benchmarks import harness
from loraplex import ops
from loraplex.ops.formats import Mxfp4Weight
from loraplex.ops.formats.checkpoint import init_quantized
from loraplex.ops.triton.moe_align import align_experts
from loraplex.ops.triton.moe_gemm import gemm_config
from loraplex.ops.triton.moe_gemm_quant import _moe_gemm_quant_kernel, moe_gemm_quant

dev, dt = "cuda", torch.bfloat16
gen = torch.Generator(dev).manual_seed(0)
E, H, I, TOPK, T = 32, 2880, 2880, 4, 16
out = {}

def q(shape):
    w = Mxfp4Weight(shape, dt, device=dev)
    init_quantized(w, 0.02, gen)
    return w

def ids_over(m):
    logits = torch.randn(T, E, device=dev, generator=gen)
    logits[:, m:] = -1e9
    return ops.route_experts(logits, TOPK, True)

def time_gemm(ws, which, m=E, cfg_from=None):
    weights, ids = ids_over(m)
    cfg = gemm_config(cfg_from or ws[0], T, TOPK)
    al = align_experts(ids, E, cfg["BLOCK_M"])
    n_w, k = ws[0].shape[1], ws[0].shape[2]
    if which == "gu":
        a = torch.randn(T, k, device=dev, generator=gen).to(dt) * 0.5
        o = torch.empty(T * TOPK, n_w // 2, dtype=dt, device=dev)
        def fn():
            return [moe_gemm_quant(a, w, None, o, al, cfg, TOPK, activation="swiglu_oai", limit=7.0) for w in ws]
    else:
        a = torch.randn(T * TOPK, k, device=dev, generator=gen).to(dt) * 0.5
        o = torch.empty(T * TOPK, n_w, dtype=dt, device=dev)
        def fn():
            return [moe_gemm_quant(a, w, None, o, al, cfg, 1, routed_weights=weights.float().contiguous().view(-1)) for w in ws]
    return harness.graph_ms(fn, per=len(ws)) * 1000, int(ids.unique().numel())

res = []
for which, (n, k) in (("gu", (2 * I, H)), ("d", (H, I))):
    base_w = [q((E, n, k)) for _ in range(2)]
    for s in (1, 2, 3):
        ws = base_w if s == 1 else [q((E, n * s, k // s)) for _ in range(2)]
        us, hit = time_gemm(ws, which, cfg_from=base_w[0])
        res.append(dict(which=which, split=s, us=us, hit=hit))
        print(f"{which} split {s}: N {n*s} K {k//s}: {us:.1f} us ({hit} experts hit)", flush=True)
        del ws
    for m in (4, 8, 12, 16, 20, 24, 28, 32):
        us, hit = time_gemm(base_w, which, m)
        res.append(dict(which=which, experts=m, us=us, hit=hit))
        print(f"{which} routed over {m} experts ({hit} hit): {us:.1f} us", flush=True)
    del base_w
try:
    for _key, k in _moe_gemm_quant_kernel.device_caches[0][0].items():
        print("regs", k.n_regs, "spills", k.n_spills, "shared", k.metadata.shared)
except Exception as e:
    print("no regs:", e)
json.dump(res, open(os.environ.get("OUT", ".") + "/waves.json", "w"), indent=1)
