"""The LoRA kernels on the step a serving run actually makes with prefill tokens: 2048
tokens = a few prompt chunks (one adapter each) plus one decode token for each other
running request (an adapter each), on Llama-3.1-8B's projections. Sweeps the shrink's
split-K and block sizes against the base GEMM of the same projection.

    python benchmarks/prefill_lora.py [--chunks 4] [--decodes 28] [--act-only]

Then gate/up's expand + SiLU-and-multiply against the two fused (`ops.lora_act_and_mul`).
"""

from __future__ import annotations

import argparse
import importlib

import torch
from kernels import PROJECTIONS, bench, projection_tensors  # benchmarks/: the script's own directory

from loraplex import ops
from loraplex.ops.metadata import make_lora_batch


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--decodes", type=int, default=28)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--interleaved", action="store_true",
                   help="token i uses adapter i %% 32 instead (every group spread over the step)")
    p.add_argument("--act-only", action="store_true", help="only gate/up's expand + activation")
    args = p.parse_args()
    ops.use_backend("triton")
    dev, rank, max_loras = "cuda", args.rank, 32
    per_chunk = (args.tokens - args.decodes) // args.chunks
    slots = list(range(args.chunks, args.chunks + args.decodes))
    for c in range(args.chunks):
        slots += [c] * per_chunk
    if args.interleaved:
        slots = [i % max_loras for i in range(args.tokens)]
    batch = make_lora_batch(slots, [rank] * max_loras, max_loras, dev)
    tokens = len(slots)
    sgmv = importlib.import_module("loraplex.ops.triton.lora_shrink_sgmv")
    expand = importlib.import_module("loraplex.ops.triton.lora_expand_sgmv")
    shape = ("interleaved" if args.interleaved else
             f"{args.chunks} chunks of {per_chunk} + {args.decodes} decode tokens")
    print(f"{tokens} tokens: {shape}, {len(batch.groups)} adapters; microseconds, CUDA-graph replays")
    base_shrink, base_expand = sgmv.shrink_config, expand.expand_config
    total = {}
    for name, (k, outs) in {} if args.act_only else PROJECTIONS.items():
        n = sum(outs)
        x, w, a, b = projection_tensors(tokens, k, outs, max_loras, rank, dev)
        y = x @ w.T
        buf = ops.lora_shrink(x, a, batch)
        row = {"gemm": bench(lambda: torch.mm(x, w.T)) * 1e3}
        for bm, bk, split in [(64, 64, 1), (32, 128, 2), (32, 128, 4), (32, 128, 8), (32, 256, 4),
                              (64, 128, 4), (16, 128, 2)]:
            sgmv.shrink_config = lambda t, kk, c=dict(BLOCK_M=bm, BLOCK_K=bk, SPLIT_K=split, num_warps=4): c
            row[f"shrink m{bm} k{bk} s{split}"] = bench(lambda: ops.lora_shrink(x, a, batch)) * 1e3
        sgmv.shrink_config = base_shrink
        for bm, bn, tb in [(64, 128, 4), (32, 128, 4), (16, 128, 4), (16, 256, 4), (32, 256, 4),
                           (32, 128, 8), (32, 64, 4), (16, 128, 8)]:
            expand.expand_config = lambda t, c=dict(BLOCK_M=bm, BLOCK_N=bn, TILE_BLOCKS=tb, num_warps=4): c
            run = lambda: ops.lora_expand(buf, b, y, tuple(outs), batch)  # noqa: E731
            row[f"expand m{bm} n{bn} t{tb}"] = bench(run) * 1e3
        expand.expand_config = base_expand
        y_bytes = tokens * n * 2
        row["expand floor (y read+write)"] = 2 * y_bytes / 4.3e12 * 1e6
        row["shrink floor (x read)"] = tokens * k * 2 / 4.3e12 * 1e6
        for key, v in row.items():
            total[key] = total.get(key, 0.0) + v
        print(name, {key: round(v, 1) for key, v in row.items()}, flush=True)
    print("sum over q/k/v, o, gate/up, down:", {key: round(v, 1) for key, v in total.items()})
    gate_up_activation(tokens, batch, max_loras, rank, dev)


def gate_up_activation(tokens, batch, max_loras, rank, dev):
    """gate/up's expand + the SiLU-and-multiply, against the two fused (configs swept)."""
    act = importlib.import_module("loraplex.ops.triton.lora_act_sgmv")
    k, outs = PROJECTIONS["gate_up"]
    x, w, a, b = projection_tensors(tokens, k, outs, max_loras, rank, dev)
    y = x @ w.T
    buf = ops.lora_shrink(x, a, batch)
    row = {"silu_and_mul alone": bench(lambda: ops.silu_and_mul(y)) * 1e3,
           "expand + silu_and_mul": bench(lambda: (ops.lora_expand(buf, b, y, tuple(outs), batch),
                                                   ops.silu_and_mul(y))) * 1e3}
    base = act.act_config
    for bm, bn, tb, warps in [(16, 256, 4, 4), (16, 128, 4, 4), (16, 128, 8, 4), (16, 128, 16, 4),
                              (16, 64, 8, 4), (16, 64, 16, 4), (16, 128, 8, 2), (16, 64, 16, 2)]:
        act.act_config = lambda t, c=dict(BLOCK_M=bm, BLOCK_N=bn, TILE_BLOCKS=tb, num_warps=warps): c
        row[f"fused m{bm} n{bn} t{tb} w{warps}"] = bench(
            lambda: ops.lora_act_and_mul(y, buf, b, batch, "silu")) * 1e3
    act.act_config = base
    row["floor (gate_up read, out write)"] = tokens * sum(outs) * 3 // 2 * 2 / 4.3e12 * 1e6
    print("gate_up activation:", {key: round(v, 1) for key, v in row.items()})


if __name__ == "__main__":
    main()
