"""Where an eager step with prefill tokens spends its host time.

Decode steps replay CUDA graphs; steps with prefill tokens run eagerly, so the host
launches every kernel of every layer. This script times such steps (host time inside
`runner.launch`, device time from the step's timing events) without and with adapters,
profiles the host side with cProfile, and measures the host cost of one Triton launch
against a torch op.

    python benchmarks/profile_prefill.py [--model llama-3.1-8b] [--adapters 32]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from pathlib import Path

import torch

from loraplex import LLM, SamplingParams
from loraplex.bench.workload import prepare_model_dir, random_adapter_requests


def prefill_steps(engine, loras, label, batch, prompt_len, seed):
    """Admit `batch` fresh requests and step until each has its first token; return the
    (launch ms, device ms, tokens) of the steps with prefill tokens."""
    sp = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    g = torch.Generator().manual_seed(seed)
    for i in range(batch):
        prompt = torch.randint(1000, 30000, (prompt_len,), generator=g).tolist()
        engine.add_request(f"{label}-{seed}-{i}", prompt, sp, loras[i % len(loras)] if loras else None)
    engine.step_log = []
    while engine.has_unfinished_requests():
        engine.step()
    torch.cuda.synchronize()
    rows = []
    for _, tokens, _, launch, _, events, *_ in engine.step_log:
        if tokens > batch:
            dev = events[0].elapsed_time(events[1]) if events else float("nan")
            rows.append((launch * 1e3, dev, tokens))
    engine.step_log = None
    return rows


def summary(rows):
    return (f"{len(rows)} steps, {statistics.median(r[2] for r in rows):.0f} tokens, "
            f"launch {statistics.median(r[0] for r in rows):.1f} ms, "
            f"device {statistics.median(r[1] for r in rows):.1f} ms (medians)")


def triton_launch_cost():
    """Host microseconds per launch of a real kernel (RMSNorm on one row) through
    `kernel[grid](...)`, through the compiled kernel's launcher directly, and of a torch op."""
    import importlib

    # The package exports a function of that name.
    mod = importlib.import_module("loraplex.ops.triton.rms_norm")

    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    args = (x, x, w, out, out, 4096, 1e-6, x.stride(0), 1, x.stride(0), out.stride(0), 1)
    kw = dict(INNER=1, HAS_RESIDUAL=False, UNIT_OFFSET=False, BLOCK_N=4096)
    compiled = mod._rms_norm_kernel[(1,)](*args, **kw)
    n = 3000

    def timed(fn):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()
        return t

    res = {"jit": timed(lambda: mod._rms_norm_kernel[(1,)](*args, **kw))}
    try:
        stream = torch.cuda.current_stream().cuda_stream
        allargs = args + tuple(kw.values())
        res["compiled.run"] = timed(lambda: compiled.run(1, 1, 1, stream, compiled.function,
                                                         compiled.packed_metadata, None, None, None,
                                                         *allargs))
    except Exception as e:  # noqa: BLE001 - a probe: report what this Triton version says
        res["compiled.run"] = f"failed: {type(e).__name__}: {e}"
    res["torch.add"] = timed(lambda: torch.add(x, x, out=out))
    res["torch.empty"] = timed(lambda: torch.empty(2048, 16, device="cuda"))
    res["torch.zeros"] = timed(lambda: torch.zeros(2048, 16, device="cuda"))
    main, aux = torch.cuda.current_stream(), torch.cuda.Stream()

    def hop():
        aux.wait_stream(main)
        with torch.cuda.stream(aux):
            pass
        main.wait_stream(aux)

    res["stream hop"] = timed(hop)
    return res


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--adapters", type=int, default=32)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "loraplex" / "bench"))
    args = p.parse_args()

    print("host us per call:", {k: (round(v, 2) if isinstance(v, float) else v)
                                for k, v in triton_launch_cost().items()}, flush=True)
    model_dir, _ = prepare_model_dir(args.model, Path(args.cache_dir))
    llm = LLM(str(model_dir), load_format="dummy", dtype="bfloat16", max_loras=args.adapters,
              max_lora_rank=16, max_num_seqs=args.batch, max_model_len=args.prompt_len + 64,
              max_num_batched_tokens=args.max_num_batched_tokens)
    engine = llm.engine
    loras = random_adapter_requests(engine, model_dir, Path(args.cache_dir), args.adapters)

    for label, use in [("base", False), ("adapters", True), ("base", False), ("adapters", True)]:
        rows = []
        for seed in range(3):
            rows += prefill_steps(engine, loras if use else None, label, args.batch, args.prompt_len, seed)
        print(f"[{label}] {summary(rows)}", flush=True)

    prof = cProfile.Profile()
    prof.enable()
    prefill_steps(engine, loras, "cprofile", args.batch, args.prompt_len, 99)
    prof.disable()
    print("cProfile of the adapter run (all steps; prefill steps dominate):")
    pstats.Stats(prof).sort_stats("tottime").print_stats(35)


if __name__ == "__main__":
    main()
