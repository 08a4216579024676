"""What programmatic dependent launch (ops/triton/launch.py) saves between the engine's
small kernels: a CUDA graph of chained launches, each reading what the one before wrote,
with PDL off (LORAPLEX_PDL=0) and on. RESULTS.md: "Programmatic dependent launch".

Chains (decode-sized: 16 rows of 2,048):
  norm   ops rms_norm, a launch with almost no work;
  gemv   the FP8 weight-only GEMM, W [2,048, 2,048] (eight distinct weights in turn, so
         they stream from memory as a decode step's do);
  both   the two alternating.
Prints microseconds a launch for each chain and form, and checks that both forms give
the same bits.

Usage: python -m benchmarks.pdl_probe [--chain 200] [--out pdl.json]
"""

from __future__ import annotations

import os

from benchmarks import harness

ROWS, HIDDEN = 16, 2048


def set_pdl(on: bool) -> None:
    """PDL on or off for the launches from here on (the engine reads LORAPLEX_PDL once)."""
    from loraplex.ops.triton import launch

    os.environ["LORAPLEX_PDL"] = "1" if on else "0"
    launch._enabled.cache_clear()


def chain(kind: str, length: int):
    """A function launching `length` kernels of `kind`, each reading the previous output,
    and returning the last one's."""
    import torch

    from loraplex.ops.reference.quant import quantize_fp8
    from loraplex.ops.triton.fp8_gemm import fp8_linear
    from loraplex.ops.triton.rms_norm import rms_norm

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
    norm_w = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
    ws = [quantize_fp8((torch.randn(HIDDEN, HIDDEN, device="cuda", generator=gen) * 0.02).bfloat16(), 128)
          for _ in range(8)]

    def run():
        y = x
        for i in range(length):
            which = kind if kind != "both" else ("norm" if i % 2 else "gemv")
            y = rms_norm(y, norm_w, 1e-6) if which == "norm" else fp8_linear(y, ws[i % len(ws)], None)
        return y
    return run


def main(argv=None) -> None:
    p = harness.parser(__doc__)
    p.add_argument("--chain", type=int, default=200, help="launches in one chain")
    args = p.parse_args(argv)
    import torch

    rows = []
    for kind in ("norm", "gemv", "both"):
        for on in (False, True):
            set_pdl(on)
            us = harness.graph_ms(chain(kind, args.chain), rep=20) * 1e3 / args.chain
            rows.append(dict(chain=kind, pdl=on, us_per_launch=us))
            print(f"{kind:5s} PDL {'on ' if on else 'off'} {us:7.2f} us a launch", flush=True)
    outs = []
    for on in (False, True):  # the same bits both ways, replayed from a graph
        set_pdl(on)
        run = chain("both", 8)
        run()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = run()
        g.replay()
        torch.cuda.synchronize()
        outs.append(y.clone())
    same = torch.equal(outs[0], outs[1])
    print("same output with and without PDL:", same)
    harness.write_json(args.out, dict(chain=args.chain, rows=rows, same_output=same), args)
    assert same


if __name__ == "__main__":
    main()
