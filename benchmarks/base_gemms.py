"""The base model's projection GEMMs (y = x W^T, bf16) at decode and prefill token counts,
with cuBLAS and cuBLASLt, against the bandwidth and bf16 floors; with --quantization awq,
the W4A16 GEMM of int4 weights (groups of 128) with its configs (the tuned file of this
GPU where one covers the count, else the defaults) and with the defaults alone.

    python -m benchmarks.base_gemms [--tokens 32 1024 1488 1536 2048] [--blas cublas cublaslt]
    python -m benchmarks.base_gemms --quantization awq --tokens 16 32 64

Each case runs every layer's distinct weights (Llama-3.1-8B: 32 layers) back to back in one
CUDA graph, so the weights come from HBM, not L2, as in the model; times are per layer
and projection (median of graph replays). A decode step (32 tokens) is bound by the
weights' bytes (TB/s reached); a step with prefill tokens by FLOPs (TFLOP/s reached; on
an H200 at its 700 W power cap ~640, not the 790 of a square GEMM).

Figures: benchmarks/RESULTS.md, "Base GEMMs" (the decode GEMMs cuBLASLt runs, and the
prefill GEMMs behind the base-TPOT budget of "Llama-3.1-8B, 32 adapters").
"""

from __future__ import annotations

from benchmarks import harness


def build_parser():
    p = harness.parser(__doc__)
    p.add_argument("--model", default="llama-3.1-8b", help="a dense bundled config (default: %(default)s)")
    p.add_argument("--tokens", type=int, nargs="+", default=[32, 1024, 1488, 1536, 2048])
    p.add_argument("--blas", nargs="+", default=["cublas", "cublaslt"], choices=["cublas", "cublaslt"])
    p.add_argument("--quantization", choices=["awq"], default=None,
                   help="time the int4 GEMM (int4_linear) instead of cuBLAS (--blas unused)")
    harness.add_floor_arguments(p)
    return p


def int4_cases(shape, gemms: dict, dev):
    """(config label, picker) pairs and the layers' int4 weights: `picker(m, n, k)` gives
    the config int4_linear is handed (None: its own choice, int4_config)."""
    import torch

    from loraplex.ops.formats import Int4Weight
    from loraplex.ops.reference.quant import quantize_int4
    from loraplex.ops.triton.int4_configs import default_config
    from loraplex.ops.triton.int4_gemm import DEQUANTIZE_MIN_TOKENS

    weights = {}
    for name, (n, k) in gemms.items():
        weights[name] = []
        for _ in range(shape.layers):  # N(0, 0.02) quantized, as the dummy int4 weights are
            w = Int4Weight((n, k), 128, torch.bfloat16, dev)
            quantize_int4(torch.empty(n, k, device=dev).normal_(0, 0.02), 128, symmetric=False, out=w)
            weights[name].append(w)
    def defaults(m, n, k):  # (from DEQUANTIZE_MIN_TOKENS both dequantize W and run cuBLAS)
        return default_config(m, n, k, 128, torch.device(dev)) if m < DEQUANTIZE_MIN_TOKENS else None

    return (("int4 configs", lambda m, n, k: None), ("int4 defaults", defaults)), weights


def main(argv=None):
    args = build_parser().parse_args(argv)
    import torch

    shape, fl = harness.model_shape(args.model), harness.floors(args)
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    gemms = {name: (sum(outs), k) for name, (k, outs) in shape.projections().items()}  # name: (N, K)
    # Operands as a serving run feeds them: loraplex's dummy weights, N(0, 0.02), and the
    # unit-RMS rows of an RMSNorm output. (The values matter little, but all-zero operands
    # draw less power and run faster: a bound, never a figure.)
    if args.quantization:
        from loraplex.ops.triton.int4_gemm import int4_linear

        cases, weights = int4_cases(shape, gemms, dev)
    else:
        cases = [(lib, lib) for lib in args.blas]
        weights = {name: [torch.empty(n, k, device=dev, dtype=dt).normal_(0, 0.02)
                          for _ in range(shape.layers)] for name, (n, k) in gemms.items()}
    rows = []
    try:
        for lib, how in cases:
            if not args.quantization:
                torch.backends.cuda.preferred_blas_library(how)
            for m in args.tokens:
                cells, layer_us, layer_flop, layer_bytes = [], 0.0, 0, 0
                for name, (n, k) in gemms.items():
                    x = torch.randn(m, k, device=dev, dtype=dt)
                    y = torch.empty(m, n, device=dev, dtype=dt)
                    ws = weights[name]
                    if args.quantization:  # W: 4 bits a weight, a bf16 scale and zero per 128
                        cfg = how(m, n, k)
                        us = harness.graph_ms(lambda: [int4_linear(x, w, None, cfg) for w in ws],  # noqa: B023
                                              per=len(ws)) * 1e3
                        nbytes = n * k // 2 + n * k // 128 * 4 + m * (n + k) * 2
                    else:
                        us = harness.graph_ms(lambda: [torch.mm(x, w.T, out=y) for w in ws],  # noqa: B023
                                              per=len(ws)) * 1e3
                        nbytes = (n * k + m * (n + k)) * 2
                    flop = 2 * m * n * k
                    frac = fl.ms(nbytes, flop) * 1e3 / us
                    rows.append(dict(blas=lib, tokens=m, proj=name, us=us, TBps=nbytes / us / 1e6,
                                     TFLOPps=flop / us / 1e6, frac=frac))
                    cells.append(f"{name} {us:7.1f} us {nbytes / us / 1e6:4.2f} TB/s "
                                 f"{flop / us / 1e6:4.0f} TF")
                    layer_us, layer_flop, layer_bytes = layer_us + us, layer_flop + flop, layer_bytes + nbytes
                rows.append(dict(blas=lib, tokens=m, proj="layer", us=layer_us,
                                 TBps=layer_bytes / layer_us / 1e6, TFLOPps=layer_flop / layer_us / 1e6,
                                 frac=fl.ms(layer_bytes, layer_flop) * 1e3 / layer_us))
                print(f"{lib:8s} M={m:5d}: layer {layer_us:7.1f} us "
                      f"({layer_bytes / layer_us / 1e6:4.2f} TB/s, "
                      f"{layer_flop / layer_us / 1e6:4.0f} TF/s, {layer_us / m * 1e3:6.1f} ns/token)  "
                      + " | ".join(cells), flush=True)
    finally:
        torch.backends.cuda.preferred_blas_library("default")
    harness.write_json(args.out, rows, args)


if __name__ == "__main__":
    main()
