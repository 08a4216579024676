"""MoE layer kernels against their memory floor, and a quick decode-size tuning pass.

For each model's expert shapes and token count: the time of ops.fused_experts (Triton,
with and without expert adapters), the bytes of the experts that routing touched
(each read once is the floor) and the fraction of the GPU's bandwidth that reaches.
With --tune, the grouped GEMM's block configs are tuned for the given token counts on a
reduced search space (`loraplex tune` runs the full one) and written to --config-dir;
the timings are then taken again with them.

    python benchmarks/moe_kernels.py [--tokens 16] [--tune --config-dir DIR]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

SHAPES = {  # name: (experts, hidden, intermediate, top_k)
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "gpt-oss-20b": (32, 2880, 2880, 4),
}
PEAK_GBS = {"H200": 4800, "H100": 3350}


def bench(name, t, rank=16, slots=16):
    from loraplex import ops
    from loraplex.ops.metadata import MoELoRA
    from loraplex.ops.triton import fused_experts
    from loraplex.ops.triton.tune_moe import time_ms

    e, h, i, k = SHAPES[name]
    dev, dt = "cuda", torch.bfloat16
    gen = torch.Generator(dev).manual_seed(0)
    w_gu = (torch.randn(e, 2 * i, h, device=dev, generator=gen) * 0.02).to(dt)
    w_d = (torch.randn(e, h, i, device=dev, generator=gen) * 0.02).to(dt)
    x = torch.randn(t, h, device=dev, generator=gen).to(dt)
    weights, ids = ops.route_experts(torch.randn(t, e, device=dev, generator=gen), k, True)
    touched = ids.unique().numel()
    floor_bytes = touched * (3 * h * i) * 2
    lora = MoELoRA(torch.randn(slots, e, 2 * rank, h, device=dev, dtype=dt) * 0.01,
                   torch.randn(slots, e, 2 * i, 2 * rank, device=dev, dtype=dt) * 0.01,
                   torch.randn(slots, e, rank, i, device=dev, dtype=dt) * 0.01,
                   torch.randn(slots, e, h, rank, device=dev, dtype=dt) * 0.01,
                   torch.arange(t, device=dev, dtype=torch.int32) % slots)
    base = time_ms(lambda: fused_experts(x, weights, ids, w_gu, w_d))
    with_lora = time_ms(lambda: fused_experts(x, weights, ids, w_gu, w_d, lora=lora))
    gpu = next((g for g in PEAK_GBS if g in torch.cuda.get_device_name()), "H100")
    floor_ms = floor_bytes / PEAK_GBS[gpu] / 1e6
    print(f"{name} T={t}: {touched}/{e} experts, {floor_bytes / 2**20:.0f} MiB; base {base * 1e3:.1f} us "
          f"({floor_ms / base:.0%} of the {gpu} bandwidth floor {floor_ms * 1e3:.1f} us), "
          f"with 16 adapters {with_lora * 1e3:.1f} us")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 2048])
    p.add_argument("--tune", type=int, nargs="*", default=None, help="token counts to tune")
    p.add_argument("--config-dir", default=None)
    args = p.parse_args()
    if args.config_dir:
        os.environ["LORAPLEX_MOE_CONFIG_DIR"] = args.config_dir
    for name in SHAPES:
        for t in args.tokens:
            bench(name, t)
    if args.tune:
        import loraplex.ops.triton.tune_moe as tm

        full = tm.candidates

        def reduced(*a, **kw):  # pipelines of 3-4 stages, 4 warps at most 8: ~1/4 of the space
            return [c for c in full(*a, **kw) if c["num_stages"] in (3, 4)]

        tm.candidates = reduced
        for e, h, i, k in SHAPES.values():
            tm.tune(e, h, i, k, torch.bfloat16, args.tune, Path(args.config_dir))
        from loraplex.ops.triton import moe_configs

        moe_configs.load_configs.cache_clear()
        print("tuned:")
        for name in SHAPES:
            for t in args.tokens:
                bench(name, t)


if __name__ == "__main__":
    main()
