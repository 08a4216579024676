"""Decode-step GPU time under kernel tunables, each variant a fresh engine and graphs.

    python benchmarks/decode_variants.py

For each variant: CUDA-graph replay time of a decode step, 32 sequences at ~600 tokens
of context, base model and 32 distinct rank-16 adapters.
"""

from __future__ import annotations

import gc
import importlib
from pathlib import Path

import torch

from loraplex import LLM, SamplingParams
from loraplex.bench.workload import prepare_model_dir, random_adapter_requests

CACHE = Path("/tmp/lp")
PKG = "loraplex.ops.triton."
VARIANTS = {
    "current": {},
    "no aux stream": {"aux_stream": None},
    "shrink 8 programs/SM": {PKG + "lora_shrink_gemv.PROGRAMS_PER_SM": 8},
    "shrink 2 programs/SM": {PKG + "lora_shrink_gemv.PROGRAMS_PER_SM": 2},
    "shrink BLOCK_K 512": {PKG + "lora_shrink_gemv.BLOCK_K": 512},
    "expand BLOCK_N 512": {PKG + "lora_expand_gemv.BLOCK_N": 512},
    "expand BLOCK_N 128": {PKG + "lora_expand_gemv.BLOCK_N": 128},
}


def replay_ms(runner, shape, with_lora, reps=30):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    runner.graphs.replay(shape, with_lora)
    start.record()
    for _ in range(reps):
        runner.graphs.replay(shape, with_lora)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def run_variant(model_dir, overrides, batch=32, adapters=32, prompt_len=512):
    saved = {}
    for key, value in overrides.items():
        if key == "aux_stream":
            continue
        mod_name, attr = key.rsplit(".", 1)
        mod = importlib.import_module(mod_name)
        saved[key] = (mod, attr, getattr(mod, attr))
        setattr(mod, attr, value)
    llm = LLM(str(model_dir), load_format="dummy", dtype="bfloat16", max_loras=adapters,
              max_lora_rank=16, max_num_seqs=batch, max_model_len=prompt_len + 256,
              enforce_eager="aux_stream" in overrides)
    engine, runner = llm.engine, llm.engine.runner
    if "aux_stream" in overrides:  # recapture the graphs without the second stream
        from loraplex import ops
        from loraplex.runner.cuda_graphs import StepGraphs

        runner.aux_stream = None
        runner.graphs = StepGraphs(runner.model, runner.inputs, batch, None, True, None)
        with ops.using_backend("triton"):
            runner.graphs.capture()
    loras = random_adapter_requests(engine, model_dir, CACHE, adapters)
    sp = SamplingParams(temperature=1.0, max_tokens=200, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [1000 + i] * prompt_len, sp, loras[i % adapters])
    for _ in range(60):
        engine.step()
    shape = runner.graphs.shape_for(batch, batch)
    out = (replay_ms(runner, shape, False), replay_ms(runner, shape, True))
    for _, (mod, attr, value) in saved.items():
        setattr(mod, attr, value)
    del llm, engine, runner
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main():
    model_dir, _ = prepare_model_dir("llama-3.1-8b", CACHE)
    print(f"{'variant':28} {'base ms':>8} {'32 adapters ms':>15} {'ratio':>6}")
    for name, overrides in VARIANTS.items():
        base, lora = run_variant(model_dir, overrides)
        print(f"{name:28} {base:8.3f} {lora:15.3f} {lora / base:6.3f}", flush=True)


if __name__ == "__main__":
    main()
