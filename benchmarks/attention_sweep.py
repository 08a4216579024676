"""Decode attention (split-KV over the paged cache) on the benchmarked models' shapes,
each config of the split kernel against the KV bytes' floor.

    python benchmarks/attention_sweep.py [--out results.json] [--bandwidth 4.8e12]

Shapes are those of a decode step of `loraplex bench`'s workloads: block tables as wide
as the engine's (max_model_len), pages in allocation order, contexts of prompt + a few
tokens. Times are medians of CUDA-graph replays.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math

import torch
import triton

from loraplex import ops
from loraplex.ops.metadata import AttentionBatch
from loraplex.ops.triton import paged_decode

# name: (seqs, context, max_model_len, q heads, kv heads, head_dim, window, sinks)
SHAPES = {
    "qwen3-30b-a3b 16 x 1650": (16, 1650, 2200, 32, 4, 128, None, False),
    "gpt-oss-20b full 16 x 1650": (16, 1650, 2200, 64, 8, 64, None, True),
    "gpt-oss-20b window 16 x 1650": (16, 1650, 2200, 64, 8, 64, 128, True),
    "llama-3.1-8b 32 x 600": (32, 600, 640, 32, 8, 128, None, False),
}


def make_case(seqs, ctx, max_len, hq, hkv, d, page=16, dev="cuda"):
    width = math.ceil(max_len / page)
    kc = torch.randn(seqs * width, page, hkv, d, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    tables = torch.arange(seqs * width, dtype=torch.int32, device=dev).view(seqs, width)
    i32 = dict(dtype=torch.int32, device=dev)
    batch = AttentionBatch(
        slot_mapping=torch.zeros(seqs, dtype=torch.int64, device=dev),
        query_start_loc=torch.arange(seqs + 1, **i32), seq_lens=torch.full((seqs,), ctx, **i32),
        block_tables=tables, query_start_loc_cpu=list(range(seqs + 1)), seq_lens_cpu=[ctx] * seqs,
        max_query_len=1, max_seq_len=ctx,
    )
    q = torch.randn(seqs, hq, d, device=dev, dtype=torch.bfloat16)
    return q, kc, vc, batch


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--bandwidth", type=float, default=4.8e12, help="bytes/s for the floor")
    args = p.parse_args()
    grid = [dict(BLOCK_N=bn, NUM_WARPS=w, NUM_STAGES=st, TARGET_PROGRAMS=tp)
            for bn, w, st, tp in itertools.product((32, 64, 128), (4, 8), (2, 3, 4), (264, 528, 1056))]
    saved = {k: getattr(paged_decode, k) for k in grid[0]}
    results = []
    for name, (seqs, ctx, max_len, hq, hkv, d, window, sinks) in SHAPES.items():
        q, kc, vc, batch = make_case(seqs, ctx, max_len, hq, hkv, d)
        sink = torch.randn(hq, device="cuda") if sinks else None
        keys = min(ctx, window + 63) if window else ctx
        floor_us = seqs * keys * hkv * d * 2 * 2 / args.bandwidth * 1e6
        with ops.using_backend("triton"):
            ref = ops.paged_attention(q, kc, vc, batch, d**-0.5, window, sink)
            rows = []
            for setting in [saved] + grid:
                for k, v in setting.items():
                    setattr(paged_decode, k, v)
                try:
                    out = ops.paged_attention(q, kc, vc, batch, d**-0.5, window, sink)
                    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                    us = 1e3 * triton.testing.do_bench_cudagraph(
                        lambda: ops.paged_attention(q, kc, vc, batch, d**-0.5, window, sink),
                        rep=30, return_mode="median")
                except Exception as exc:  # e.g. out of shared memory
                    err, us = float("nan"), float("inf")
                    print(f"  {setting}: {type(exc).__name__}")
                rows.append(dict(shape=name, **setting, us=us, floor_us=floor_us, err=err))
            for k, v in saved.items():
                setattr(paged_decode, k, v)
        base, best = rows[0], min(rows[1:], key=lambda r: r["us"])
        results += rows
        print(f"{name}: floor {floor_us:.1f} us; now {base['us']:.1f} us; best {best['us']:.1f} us "
              f"({ {k: best[k] for k in saved} }, err {best['err']:.1e})")
        for r in sorted(rows[1:], key=lambda r: r["us"])[:6]:
            print(f"    {r['us']:7.1f} us  BN {r['BLOCK_N']:3d} w {r['NUM_WARPS']} st {r['NUM_STAGES']} "
                  f"tp {r['TARGET_PROGRAMS']:4d}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
