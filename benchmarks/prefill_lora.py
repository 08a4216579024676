"""The LoRA kernels on the step a serving run makes with prefill tokens, kernel configs
side by side: 2,048 tokens = a few prompt chunks (one adapter each) plus one decode
token for each other running request (an adapter each), on Llama-3.1-8B's projections.

    python -m benchmarks.prefill_lora [--tokens 2048] [--chunks 4] [--decodes 28] [--interleaved]
    python -m benchmarks.prefill_lora --act-only --tokens 1536 --chunks 3 --decodes 28

Per projection (q/k/v, o, gate/up, down): the base GEMM, the SGMV shrink over split-K and
block sizes, the SGMV expand over tile shapes, and their floors (x read; y read and
written at the bandwidth floor); then the sum over the four. Last, gate/up's expand +
SiLU-and-multiply against the two fused (`ops.lora_act_and_mul`), its configs swept.
Microseconds per layer, medians of CUDA-graph replays.

Figures: benchmarks/RESULTS.md, "LoRA kernels in a step with prefill tokens".
"""

from __future__ import annotations

from benchmarks import harness


def us(fn) -> float:
    return harness.graph_ms(fn, rep=50) * 1e3


def projections(shape, tokens, batch, max_loras, rank, fl: harness.Floors) -> dict:
    """Shrink and expand configs on every projection; returns the sums over them."""
    import importlib

    import torch

    from loraplex import ops

    # Engine internals: the SGMV kernels' config functions, replaced for the sweep.
    sgmv = importlib.import_module("loraplex.ops.triton.lora_shrink_sgmv")
    expand = importlib.import_module("loraplex.ops.triton.lora_expand_sgmv")
    base_shrink, base_expand = sgmv.shrink_config, expand.expand_config
    total = {}
    try:
        for name, (k, outs) in shape.projections().items():
            n = sum(outs)
            x, w, a, b = harness.projection_tensors(tokens, k, outs, max_loras, rank)
            y = x @ w.T
            buf = ops.lora_shrink(x, a, batch)
            row = {"gemm": us(lambda: torch.mm(x, w.T))}
            for bm, bk, split in [(64, 64, 1), (32, 128, 2), (32, 128, 4), (32, 128, 8), (32, 256, 4),
                                  (64, 128, 4), (16, 128, 2)]:
                cfg = dict(BLOCK_M=bm, BLOCK_K=bk, SPLIT_K=split, num_warps=4)
                sgmv.shrink_config = lambda t, kk, c=cfg: c
                row[f"shrink m{bm} k{bk} s{split}"] = us(lambda: ops.lora_shrink(x, a, batch))
            sgmv.shrink_config = base_shrink
            for bm, bn, tb in [(64, 128, 4), (32, 128, 4), (16, 128, 4), (16, 256, 4), (32, 256, 4),
                               (32, 128, 8), (32, 64, 4), (16, 128, 8)]:
                cfg = dict(BLOCK_M=bm, BLOCK_N=bn, TILE_BLOCKS=tb, num_warps=4)
                expand.expand_config = lambda t, c=cfg: c
                row[f"expand m{bm} n{bn} t{tb}"] = us(lambda: ops.lora_expand(buf, b, y, tuple(outs), batch))
            expand.expand_config = base_expand
            row["expand floor (y read+write)"] = fl.ms(2 * tokens * n * 2) * 1e3
            row["shrink floor (x read)"] = fl.ms(tokens * k * 2) * 1e3
            for key, v in row.items():
                total[key] = total.get(key, 0.0) + v
            print(name, {key: round(v, 1) for key, v in row.items()}, flush=True)
    finally:
        sgmv.shrink_config, expand.expand_config = base_shrink, base_expand
    print("sum over q/k/v, o, gate/up, down:", {key: round(v, 1) for key, v in total.items()})
    return total


def gate_up_activation(shape, tokens, batch, max_loras, rank, fl: harness.Floors) -> dict:
    """gate/up's expand + the SiLU-and-multiply, against the two fused (configs swept)."""
    import importlib

    from loraplex import ops

    # Engine internal: the fused activation kernel's config function.
    act = importlib.import_module("loraplex.ops.triton.lora_act_sgmv")
    k, outs = shape.projections()["gate_up"]
    x, w, a, b = harness.projection_tensors(tokens, k, outs, max_loras, rank)
    y = x @ w.T
    buf = ops.lora_shrink(x, a, batch)
    row = {"silu_and_mul alone": us(lambda: ops.silu_and_mul(y)),
           "expand + silu_and_mul": us(lambda: (ops.lora_expand(buf, b, y, tuple(outs), batch),
                                                ops.silu_and_mul(y)))}
    base = act.act_config
    try:
        for bm, bn, tb, warps in [(16, 256, 4, 4), (16, 128, 4, 4), (16, 128, 8, 4), (16, 128, 16, 4),
                                  (16, 64, 8, 4), (16, 64, 16, 4), (16, 128, 8, 2), (16, 64, 16, 2)]:
            act.act_config = lambda t, c=dict(BLOCK_M=bm, BLOCK_N=bn, TILE_BLOCKS=tb, num_warps=warps): c
            row[f"fused m{bm} n{bn} t{tb} w{warps}"] = us(
                lambda: ops.lora_act_and_mul(y, buf, b, batch, "silu"))
    finally:
        act.act_config = base
    row["floor (gate_up read, out write)"] = fl.ms(tokens * sum(outs) * 3 // 2 * 2) * 1e3
    print("gate_up activation:", {key: round(v, 1) for key, v in row.items()})
    return row


def build_parser():
    p = harness.parser(__doc__)
    p.add_argument("--model", default="llama-3.1-8b", help="a dense bundled config (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--chunks", type=int, default=4, help="prompt chunks, one adapter each")
    p.add_argument("--decodes", type=int, default=28, help="one-token decode groups, one adapter each")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--interleaved", action="store_true",
                   help="token i uses adapter i %% 32 instead (every group spread over the step)")
    p.add_argument("--act-only", action="store_true", help="only gate/up's expand + activation")
    harness.add_floor_arguments(p)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    from loraplex import ops
    from loraplex.ops.metadata import make_lora_batch

    ops.use_backend("triton")
    shape, fl = harness.model_shape(args.model), harness.floors(args)
    rank, max_loras = args.rank, 32
    per_chunk = (args.tokens - args.decodes) // args.chunks
    slots = list(range(args.chunks, args.chunks + args.decodes))
    for c in range(args.chunks):
        slots += [c] * per_chunk
    if args.interleaved:
        slots = [i % max_loras for i in range(args.tokens)]
    batch = make_lora_batch(slots, [rank] * max_loras, max_loras, "cuda")
    tokens = len(slots)
    layout = ("interleaved" if args.interleaved else
              f"{args.chunks} chunks of {per_chunk} + {args.decodes} decode tokens")
    print(f"{tokens} tokens: {layout}, {len(batch.groups)} adapters; microseconds, CUDA-graph replays")
    results = {"tokens": tokens, "layout": layout}
    if not args.act_only:
        results["per_layer"] = projections(shape, tokens, batch, max_loras, rank, fl)
    results["gate_up_activation"] = gate_up_activation(shape, tokens, batch, max_loras, rank, fl)
    harness.write_json(args.out, results, args)


if __name__ == "__main__":
    main()
