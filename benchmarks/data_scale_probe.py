"""Does the data in the weights change how fast the GPU runs the model's GEMMs?

    python benchmarks/data_scale_probe.py [--tokens 32 1488 2048] [--out probe.json]

An H100/H200 runs bf16 matmuls at a clock its power limit sets, and the power drawn
depends on the bits the tensor cores multiply. loraplex's dummy weights are trained-scale
(N(0, 0.02)); vLLM's dummy loader draws every tensor, norms included, from
U(-1e-3, 1e-3), so its activations are ~1e-3 times smaller. This probe times the Llama-3.1-8B
projections (32 layers of distinct weights in one CUDA graph, as gemm_probe.py) with the
weights and inputs each dummy model actually feeds them, and samples the SM clock and
power draw while they run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile

import torch
from gemm_probe import LAYERS, SHAPES, timed


def operands(kind: str, n: int, k: int, m: int, gen: torch.Generator):
    """(weights of 32 layers, input) as each dummy model produces them. The input is an
    RMSNorm output: unit-RMS rows times the norm's weight (1 for loraplex, U(+-1e-3) for
    vLLM's dummy)."""
    dev, dt = "cuda", torch.bfloat16

    def layers(init):
        return [init(torch.empty(n, k, device=dev, dtype=dt)) for _ in range(LAYERS)]

    x = torch.randn(m, k, device=dev, generator=gen)
    if kind == "loraplex":
        ws = layers(lambda w: w.normal_(0, 0.02, generator=gen))
    elif kind == "vllm":
        ws = layers(lambda w: w.uniform_(-1e-3, 1e-3, generator=gen))
        x = x * torch.empty(k, device=dev).uniform_(-1e-3, 1e-3, generator=gen)
    elif kind == "zeros":  # the bound the METHOD note warns of: never a figure to report
        ws = layers(lambda w: w.zero_())
        x = torch.zeros_like(x)
    return ws, x.to(dt)


class GpuSampler:
    """nvidia-smi sampling SM clock (MHz) and power (W) every 20 ms while a case runs."""

    def __enter__(self):
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".csv")
        self.proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
             "-lms", "20"], stdout=self.log, stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait()
        self.log.seek(0)
        rows = [line.split(",") for line in self.log.read().splitlines() if line.count(",") == 1]
        vals = [(float(a), float(b)) for a, b in rows if a.strip().replace(".", "").isdigit()]
        vals = vals[len(vals) // 4:] or vals  # past the ramp
        self.clock = sorted(v[0] for v in vals)[len(vals) // 2] if vals else float("nan")
        self.power = sorted(v[1] for v in vals)[len(vals) // 2] if vals else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[32, 1488, 2048])
    ap.add_argument("--kinds", nargs="+", default=["loraplex", "vllm", "zeros"])
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    rows = []
    for m in args.tokens:
        for kind in args.kinds:
            gen = torch.Generator(device="cuda").manual_seed(0)
            total_us, cells, clocks, powers = 0.0, [], [], []
            for name, (n, k) in SHAPES.items():
                ws, x = operands(kind, n, k, m, gen)
                y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                with GpuSampler() as s:
                    us = timed(lambda: [torch.mm(x, w.T, out=y) for w in ws], rep=400) * 1e3 / LAYERS
                total_us += us
                clocks.append(s.clock)
                powers.append(s.power)
                cells.append(f"{name} {us:6.1f}")
                rows.append(dict(tokens=m, kind=kind, proj=name, us=us, sm_mhz=s.clock, watts=s.power))
                ws.clear()
            flop = sum(2 * m * n * k for n, k in SHAPES.values())
            byts = sum(2 * n * k for n, k in SHAPES.values())
            rate = f"{flop / total_us / 1e6:4.0f} TF/s" if m > 256 else f"{byts / total_us / 1e6:4.2f} TB/s"
            print(f"M={m:5d} {kind:9s} layer {total_us:7.1f} us ({rate})"
                  f"  SM MHz {min(clocks):.0f}-{max(clocks):.0f}  W {min(powers):.0f}-{max(powers):.0f}  | "
                  + " | ".join(cells), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
