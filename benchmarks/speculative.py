"""What n-gram speculation buys and what it costs.

--workload quote: real weights (default: the default model, Gemma 3 270M, whose base and
demo adapters take turns by request). Each prompt shows a passage of a Python source
file from the standard library and starts a second copy of it, so the output repeats the
input, as an edit or a quotation does. Greedy; per concurrency (requests launched
together, --concurrency of them), after one unmeasured wave, --waves runs over the
passages: the median over requests of output tokens/s after the first, with speculation
and without; the share of proposals kept; tokens per verified step (--profile-host: one
more wave under cProfile, its costliest functions in the JSON).

--workload cost: a bundled config on dummy weights (acceptance means nothing there),
--batch sequences decoding with --prompt-len tokens of context: the wall time of an
engine step (synchronous scheduling on both sides) where every sequence verifies k
proposed tokens that are never kept, against a plain one-token decode step; then whole
runs of --output-len tokens where every request always has a proposal, never kept
(on the device too: never_kept_on_device; the scheduler's adaptivity deciding how many
it verifies), against
speculation off (both with async scheduling, the default), medians of --repeats
alternated runs.

    python -m benchmarks.speculative --workload quote [--model DIR] [--concurrency 1 2 4 8]
    python -m benchmarks.speculative --workload cost --model llama-3.1-8b --batch 16 --k 4

Figure: benchmarks/RESULTS.md, "Speculative decoding".
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from pathlib import Path

from benchmarks import harness

# Standard-library modules whose source makes the passages (plain Python text, in every
# installation).
PASSAGE_MODULES = ("textwrap", "bisect", "heapq", "fnmatch", "shlex", "colorsys", "string", "glob")
# A step's parts (benchmarks.harness.StepLog): the engine's whole step, host time in
# runner.launch, the device's time for the step's work.
STEP_PARTS = ("wall_ms", "launch_ms", "device_ms")


def build_parser():
    p = harness.parser(__doc__)
    p.add_argument("--workload", choices=["quote", "cost"], default="quote")
    p.add_argument("--model", default=None,
                   help="quote: a model directory (default: the default model); cost: a bundled config "
                        "(default: llama-3.1-8b)")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="quote: requests in flight")
    p.add_argument("--passage-chars", type=int, default=1500, help="quote: characters of source per passage")
    p.add_argument("--waves", type=int, default=3,
                   help="quote: times the passages are run at each concurrency, after one unmeasured wave")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16, help="cost: sequences in flight")
    p.add_argument("--prompt-len", type=int, default=1024, help="cost: context tokens per sequence")
    p.add_argument("--steps", type=int, default=50, help="cost: engine steps timed per variant")
    p.add_argument("--repeats", type=int, default=5, help="cost: whole runs per variant (median)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--profile-host", action="store_true",
                   help="quote: one more wave per run under cProfile; its costliest functions in the JSON")
    return p


def passages(chars: int) -> list[str]:
    import importlib

    out = []
    for name in PASSAGE_MODULES:
        text = Path(importlib.import_module(name).__file__).read_text()
        start = text.find("\ndef ")  # past the module docstring and imports
        out.append(text[max(start, 0): max(start, 0) + chars])
    return out


def quote_prompt(passage: str) -> str:
    return ("Here is a Python source file, printed twice.\n\n"
            f"First copy:\n{passage}\n\nSecond copy:\n{passage[:40]}")


def host_profile(run, top: int = 25) -> list[dict]:
    """`run()` under cProfile: its `top` functions by own time (totals over the run, ms)."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.runcall(run)
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (calls, prim, tottime, cumtime, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"function": f"{Path(f).name}:{line}({name})", "calls": calls, "tottime_ms": round(tt * 1e3, 3),
             "cumtime_ms": round(ct * 1e3, 3)} for (f, line, name), (calls, _, tt, ct, _) in rows]


def tokens_per_second(out) -> float:
    n = len(out.outputs[0].token_ids)
    return (n - 1) / (out.metrics.finished_time - out.metrics.first_token_time)


def quote(args) -> dict:
    import torch

    from loraplex import LLM, LoRARequest, SamplingParams
    from loraplex.entrypoints.default_model import default_model_dir, demo_adapters

    model = args.model or str(default_model_dir())
    loras = [None] + ([LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(demo_adapters())]
                      if args.model is None else [])
    prompts = [quote_prompt(p) for p in passages(args.passage_chars)]
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4}
    results = {}
    for label, config in (("plain", None), ("ngram", spec)):
        llm = LLM(model, dtype=args.dtype, speculative_config=config, max_loras=len(loras),
                  max_num_seqs=max(args.concurrency), max_model_len=2048)
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
        for c in args.concurrency:
            def wave(first: int, c: int = c, llm=llm) -> list:
                """c requests launched together: passages and adapters from `first` on."""
                return llm.generate([prompts[(first + j) % len(prompts)] for j in range(c)], sp,
                                    [loras[(first + j) % len(loras)] for j in range(c)], use_tqdm=False)

            wave(0)  # not measured: this batch size's first kernels
            before = llm.engine.stats()
            rates, steps = [], []
            for first in range(0, args.waves * len(prompts), c):
                with harness.StepLog(llm.engine) as log:
                    outs = wave(first)
                rates += [tokens_per_second(o) for o in outs]
                steps += log.steps()
            after = llm.engine.stats()
            drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
            kept = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
            verified = after["spec_verified_chunks"] - before["spec_verified_chunks"]
            results[f"{label} c{c}"] = {
                "tokens_per_s_per_request": statistics.median(rates),
                "acceptance_rate": kept / drafted if drafted else None,
                "tokens_per_verified_step": 1 + kept / verified if verified else None,
                # Medians over steps.
                **{f"step_{key}": statistics.median(s[key] for s in steps) for key in STEP_PARTS}}
            if args.profile_host:  # where the host's time goes (a run's spread is the host's)
                results[f"{label} c{c}"]["host_profile"] = host_profile(functools.partial(wave, 0))
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(f"{'in flight':>9s} {'plain tok/s':>12s} {'ngram tok/s':>12s} {'speedup':>8s} {'kept':>6s} "
          f"{'per step':>9s}   step ms plain / ngram: wall, launch, device")
    for c in args.concurrency:
        p, s = results[f"plain c{c}"], results[f"ngram c{c}"]
        print(f"{c:9d} {p['tokens_per_s_per_request']:12.1f} {s['tokens_per_s_per_request']:12.1f} "
              f"{s['tokens_per_s_per_request'] / p['tokens_per_s_per_request']:8.2f} "
              f"{s['acceptance_rate'] or 0:6.1%} {s['tokens_per_verified_step'] or 1:9.2f}   "
              + " / ".join(", ".join(f"{r[f'step_{key}']:.2f}" for key in STEP_PARTS) for r in (p, s)))
    return results


def cost(args) -> dict:
    from loraplex import SamplingParams

    model = args.model or "llama-3.1-8b"
    spec = {"method": "ngram", "num_speculative_tokens": args.k}
    max_len = args.prompt_len + args.output_len + (args.steps + 10) * (args.k + 1) + 64
    llm, _ = harness.dummy_llm(model, args.cache_dir, max_loras=1, max_num_seqs=args.batch,
                               max_model_len=max_len, speculative_config=spec)
    engine, scheduler = llm.engine, llm.engine.scheduler
    if engine.runner.ngram is not None:
        never_kept_on_device(engine.runner.ngram, engine.config.model.vocab_size)

    def step_ms(propose) -> float:
        """Mean wall time of an engine step with `propose` as the scheduler's proposer."""
        scheduler._propose = propose
        engine.async_scheduling = False
        harness.start_decode(engine, f"cost-{time.monotonic()}", args.batch, args.prompt_len, [],
                             (args.steps + 10) * (args.k + 1))
        engine.runner.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        engine.runner.synchronize()
        ms = (time.perf_counter() - t0) * 1e3 / args.steps
        harness.abort_all(engine, drain=True)
        return ms

    vocab = engine.config.model.vocab_size
    never_kept = lambda req, budget, probe: [vocab - 1 - i for i in range(args.k)]  # noqa: E731
    plain_propose = type(scheduler)._propose.__get__(scheduler)
    results = {"decode_step_ms": step_ms(lambda req, budget, probe: []),
               f"verify_k{args.k}_step_ms": step_ms(never_kept)}
    results["verify_over_decode"] = results[f"verify_k{args.k}_step_ms"] / results["decode_step_ms"]
    scheduler._propose = plain_propose

    def run_s(speculative) -> float:
        scheduler.speculative = speculative
        engine.async_scheduling = True
        prompts = [[1000 + i] * args.prompt_len for i in range(args.batch)]
        sp = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - t0

    class AlwaysMatches:  # SeenSuffix's question, always yes (never_kept_on_device fills them)
        def __init__(self, n_min):
            pass

        def matches(self, prompt, output):
            return True

    import loraplex.engine.scheduler as scheduler_module

    scheduler_module.SeenSuffix = AlwaysMatches
    config = scheduler.speculative
    run_s(None), run_s(config)  # warm-up
    drafted = scheduler.num_draft_tokens
    off, on = [], []
    for _ in range(args.repeats):  # alternated, so that drift (clocks, heat) falls on both
        off.append(run_s(None))
        on.append(run_s(config))
    results["run_s_speculation_off"] = statistics.median(off)
    results["run_s_speculation_on"] = statistics.median(on)
    results["on_over_off"] = results["run_s_speculation_on"] / results["run_s_speculation_off"]
    # Of the on runs' tokens, the share that was proposed (probes, and the first steps
    # before a request's acceptance falls).
    results["drafts_per_output_token"] = ((scheduler.num_draft_tokens - drafted)
                                          / (args.repeats * args.batch * args.output_len))
    for key, value in results.items():
        print(f"{key:28s} {value:10.3f}")
    return results


def never_kept_on_device(ngram, vocab: int) -> None:
    """Proposals made on the device (runner/ngram_drafts.py) that fill every draft
    position with tokens the model (nearly) never samples: written after the real
    search, from the plan's host-side layout (no sync)."""
    import torch

    from loraplex.device import to_device

    search = ngram.complete

    def complete(plan, inputs, *args):
        found = search(plan, inputs, *args)
        qsl = inputs.attn.query_start_loc_cpu
        rows, values, counts = [], [], []
        for c, chunk in enumerate(plan.chunks):
            k = len(chunk.draft_ids) if chunk.device_drafts else 0
            rows += range(qsl[c + 1] - k, qsl[c + 1])
            values += [vocab - 1 - j for j in range(k)]
            counts.append(k)
        if rows:
            device = inputs.input_ids.device
            inputs.input_ids[to_device(rows, torch.int64, device)] = to_device(values, torch.int64, device)
            found.copy_(to_device(counts, torch.int32, device))
        return found

    ngram.complete = complete


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.waves < 1:
        parser.error(f"--waves must be at least 1, got {args.waves}")
    results = quote(args) if args.workload == "quote" else cost(args)
    harness.write_json(args.out, results, args)


if __name__ == "__main__":
    sys.exit(main())
