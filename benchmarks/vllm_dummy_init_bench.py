"""`loraplex bench` with vLLM's dummy weights: every tensor, norms included, drawn from
U(-1e-3, 1e-3) instead of loraplex's trained-scale N(0, 0.02) matrices and unit norms.

    python benchmarks/vllm_dummy_init_bench.py bench --model llama-3.1-8b --num-adapters 0 ...

Takes the arguments of `loraplex bench`. It answers whether the weights' values change
the speed of a run (a power-capped GPU runs its GEMMs at a clock set by the bits they
toggle; see data_scale_probe.py): on an H200 they did not (benchmarks/NOTES.md).
"""

import sys

import torch

import loraplex.runner.model_runner as model_runner


def init_like_vllm(model, std, seed):
    gen = None
    for p in model.parameters():
        if gen is None:
            gen = torch.Generator(device=p.device).manual_seed(seed)
        p.data.uniform_(-1e-3, 1e-3, generator=gen)


model_runner.init_dummy = init_like_vllm
from loraplex.entrypoints.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
