"""Where an eager step with prefill tokens spends its host time.

Decode steps replay CUDA graphs; steps with prefill tokens run eagerly, so the host
launches every kernel of every layer. This script times such steps (host time inside
`runner.launch`, device time from the step's timing events) without and with adapters,
profiles the host side with cProfile, and measures the host cost of one Triton launch
against a torch op.

    python -m benchmarks.profile_prefill [--model llama-3.1-8b] [--adapters 32]

An engine on dummy weights (a bundled config), `--batch` requests of `--prompt-len`
random tokens at a time, `--max-num-batched-tokens` per step, base and adapter runs
alternated twice. The engine replays mixed steps from CUDA graphs by default; this
script runs it with `--cudagraph-mode FULL_DECODE_ONLY` (steps with prefill tokens eager,
its subject) unless told otherwise (FULL: the graphs, as serving runs them).

Figure: benchmarks/RESULTS.md, "Steps with prefill tokens" (host ms in launch, device
ms, host cost per call).
"""

from __future__ import annotations

import statistics

from benchmarks import harness


def prefill_steps(engine, loras, label, batch, prompt_len, seed) -> list[dict]:
    """Admit `batch` fresh requests and step until each has its first token; return the
    steps with prefill tokens (`harness.StepLog.steps()` rows)."""
    import torch

    from loraplex import SamplingParams

    sp = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    g = torch.Generator().manual_seed(seed)
    for i in range(batch):
        prompt = torch.randint(1000, 30000, (prompt_len,), generator=g).tolist()
        engine.add_request(f"{label}-{seed}-{i}", prompt, sp, loras[i % len(loras)] if loras else None)
    with harness.StepLog(engine) as log:
        while engine.has_unfinished_requests():
            engine.step()
        torch.cuda.synchronize()
    return [r for r in log.steps() if r["tokens"] > batch]


def summary(rows):
    if not rows:
        return "no steps logged (LLMEngine.step_timings: see benchmarks.harness.StepLog)"
    return (f"{len(rows)} steps, {statistics.median(r['tokens'] for r in rows):.0f} tokens, "
            f"launch {statistics.median(r['launch_ms'] for r in rows):.1f} ms, "
            f"device {statistics.median(r['device_ms'] for r in rows):.1f} ms (medians)")


def triton_launch_cost() -> dict:
    """Host microseconds per launch of a real kernel (RMSNorm on one row) through
    `kernel[grid](...)`, through the compiled kernel's launcher directly, and of torch ops."""
    import importlib

    import torch

    # Engine internal: the RMSNorm kernel and its argument list (the package exports a
    # function of the module's name).
    mod = importlib.import_module("loraplex.ops.triton.rms_norm")

    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    args = (x, x, w, out, out, 4096, 1e-6, x.stride(0), 1, x.stride(0), out.stride(0), 1)
    kw = dict(INNER=1, HAS_RESIDUAL=False, UNIT_OFFSET=False, SUM_ROWS=1, BLOCK_N=4096)
    compiled = mod._rms_norm_kernel[(1,)](*args, **kw)
    n = 3000
    res = {"jit": harness.host_us(lambda: mod._rms_norm_kernel[(1,)](*args, **kw), n)}
    try:
        stream = torch.cuda.current_stream().cuda_stream
        allargs = args + tuple(kw.values())
        res["compiled.run"] = harness.host_us(
            lambda: compiled.run(1, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None,
                                 None, *allargs), n)
    except Exception as e:  # noqa: BLE001 - a probe: report what this Triton version says
        res["compiled.run"] = f"failed: {type(e).__name__}: {e}"
    res["torch.add"] = harness.host_us(lambda: torch.add(x, x, out=out), n)
    res["torch.empty"] = harness.host_us(lambda: torch.empty(2048, 16, device="cuda"), n)
    res["torch.zeros"] = harness.host_us(lambda: torch.zeros(2048, 16, device="cuda"), n)
    main, aux = torch.cuda.current_stream(), torch.cuda.Stream()

    def hop():
        aux.wait_stream(main)
        with torch.cuda.stream(aux):
            pass
        main.wait_stream(aux)

    res["stream hop"] = harness.host_us(hop, n)
    return res


def build_parser():
    p = harness.parser(__doc__)
    p.add_argument("--model", default="llama-3.1-8b", help="a bundled config (default: %(default)s)")
    p.add_argument("--adapters", type=int, default=32)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--cudagraph-mode", default="FULL_DECODE_ONLY",
                   help="the engine's cudagraph_mode (FULL, FULL_DECODE_ONLY, NONE; default: %(default)s)")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    import cProfile
    import pstats

    cost = triton_launch_cost()
    print("host us per call:", {k: (round(v, 2) if isinstance(v, float) else v) for k, v in cost.items()},
          flush=True)
    llm, model_dir = harness.dummy_llm(args.model, args.cache_dir, max_loras=args.adapters, max_lora_rank=16,
                                       max_num_seqs=args.batch, max_model_len=args.prompt_len + 64,
                                       max_num_batched_tokens=args.max_num_batched_tokens,
                                       cudagraph_mode=args.cudagraph_mode)
    engine = llm.engine
    loras = harness.random_adapters(engine, model_dir, args.cache_dir, args.adapters)
    results = {"host_us_per_call": cost, "runs": []}
    for label, use in [("base", False), ("adapters", True), ("base", False), ("adapters", True)]:
        rows = []
        for seed in range(3):
            rows += prefill_steps(engine, loras if use else None, label, args.batch, args.prompt_len, seed)
        print(f"[{label}] {summary(rows)}", flush=True)
        results["runs"].append({"run": label, "steps": rows})

    prof = cProfile.Profile()
    prof.enable()
    prefill_steps(engine, loras, "cprofile", args.batch, args.prompt_len, 99)
    prof.disable()
    print("cProfile of the adapter run (all steps; prefill steps dominate):")
    pstats.Stats(prof).sort_stats("tottime").print_stats(35)
    harness.write_json(args.out, results, args)


if __name__ == "__main__":
    main()
