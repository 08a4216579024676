"""Decode attention (split-KV over the paged cache) on the benchmarked workloads' shapes:
every config of the split kernel against the KV bytes' floor.

    python -m benchmarks.attention_sweep [--bandwidth 4.8e12]

Shapes are those of a decode step of `loraplex bench`'s workloads (heads, KV heads, head
size, window and sinks from the bundled configs): Qwen3-30B-A3B and gpt-oss-20b at 16
sequences of 1,650 tokens, Llama-3.1-8B at 32 of 600; block tables as wide as the
engine's (max_model_len), pages in allocation order. For each shape: the current config,
then 108 configs (BLOCK_N, warps, stages, target programs); median of CUDA-graph replays,
us per call; floor = the KV bytes read once at the GPU's data-sheet bandwidth (or
--bandwidth).

Figure: benchmarks/RESULTS.md, "Decode attention".
"""

from __future__ import annotations

import itertools
import math

from benchmarks import harness

# name: (bundled config, seqs, context, max_model_len, sliding-window layers)
WORKLOADS = {
    "qwen3-30b-a3b 16 x 1650": ("qwen3-30b-a3b", 16, 1650, 2200, False),
    "gpt-oss-20b full 16 x 1650": ("gpt-oss-20b", 16, 1650, 2200, False),
    "gpt-oss-20b window 16 x 1650": ("gpt-oss-20b", 16, 1650, 2200, True),
    "llama-3.1-8b 32 x 600": ("llama-3.1-8b", 32, 600, 640, False),
}


def make_case(seqs, ctx, max_len, hq, hkv, d, page=16, dev="cuda"):
    import torch

    from loraplex.ops.metadata import AttentionBatch

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


def build_parser():
    p = harness.parser(__doc__)
    p.add_argument("--shapes", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    harness.add_floor_arguments(p, bandwidth=None)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    import torch

    from loraplex import ops

    # Engine internal: the split-KV decode kernel's module-level tunables.
    from loraplex.ops.triton import paged_decode

    bandwidth = harness.floors(args).bandwidth
    grid = [dict(BLOCK_N=bn, NUM_WARPS=w, NUM_STAGES=st, TARGET_PROGRAMS=tp)
            for bn, w, st, tp in itertools.product((32, 64, 128), (4, 8), (2, 3, 4), (264, 528, 1056))]
    saved = {k: getattr(paged_decode, k) for k in grid[0]}
    results = []
    for name in args.shapes:
        model, seqs, ctx, max_len, windowed = WORKLOADS[name]
        shape = harness.model_shape(model)
        hq, hkv, d = shape.heads, shape.kv_heads, shape.head_dim
        window = shape.window if windowed else None
        q, kc, vc, batch = make_case(seqs, ctx, max_len, hq, hkv, d)
        sink = torch.randn(hq, device="cuda") if shape.sinks else None
        keys = min(ctx, window + 63) if window else ctx
        floor_us = seqs * keys * hkv * d * 2 * 2 / bandwidth * 1e6
        with ops.using_backend("triton"):
            ref = ops.paged_attention(q, kc, vc, batch, d**-0.5, window, sink)
            rows = []
            try:
                for setting in [saved] + grid:
                    for k, v in setting.items():
                        setattr(paged_decode, k, v)
                    try:
                        out = ops.paged_attention(q, kc, vc, batch, d**-0.5, window, sink)
                        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                        us = 1e3 * harness.graph_ms(
                            lambda: ops.paged_attention(q, kc, vc, batch, d**-0.5, window, sink), rep=30)
                    except Exception as exc:  # e.g. out of shared memory
                        err, us = float("nan"), float("inf")
                        print(f"  {setting}: {type(exc).__name__}")
                    rows.append(dict(shape=name, **setting, us=us, floor_us=floor_us, err=err))
            finally:
                for k, v in saved.items():
                    setattr(paged_decode, k, v)
        base, best = rows[0], min(rows[1:], key=lambda r: r["us"])
        results += rows
        print(f"{name}: floor {floor_us:.1f} us; now {base['us']:.1f} us; best {best['us']:.1f} us "
              f"({ {k: best[k] for k in saved} }, err {best['err']:.1e})")
        for r in sorted(rows[1:], key=lambda r: r["us"])[:6]:
            print(f"    {r['us']:7.1f} us  BN {r['BLOCK_N']:3d} w {r['NUM_WARPS']} st {r['NUM_STAGES']} "
                  f"tp {r['TARGET_PROGRAMS']:4d}")
    harness.write_json(args.out, results, args)


if __name__ == "__main__":
    main()
