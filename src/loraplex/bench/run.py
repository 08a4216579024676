"""`loraplex bench`: serving benchmark in the manner of `vllm bench serve` (random dataset).

Each value of --num-adapters is one run over the same workload shape: 0 is the base
model; K > 0 spreads requests over K adapters (one run per --adapter-dist: uniform or
Zipf). In-process runs build the engine once, pre-load the adapters (as vLLM's
--lora-modules does) and warm up every kernel before timing; with --cold-adapters the
adapters stay on disk until a request needs them (the tiered store under load: loads
from disk, host and GPU evictions), and only the adapters the runs use are written.
With --base-url the same workload goes to an OpenAI-compatible server; --lora-modules
names the server's adapters, which the requests pick from as in-process runs do from
theirs (uniformly by default, as `vllm bench serve --lora-modules` does).
A run whose every request failed stops the bench with the first failure's message.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

from loraplex.bench.clients import run_http, run_in_process
from loraplex.bench.profile import compiled_kernels, pinned_allocs, step_profile
from loraplex.bench.report import format_table, plot, require_matplotlib, summarize, to_json
from loraplex.bench.stack_sampler import StackSampler
from loraplex.bench.synthetic import LINEAR_TARGETS
from loraplex.bench.workload import (
    BUNDLED_CONFIGS,
    BenchRequest,
    make_requests,
    prepare_adapters,
    prepare_model_dir,
)
from loraplex.engine.args import EngineArgs, at_least
from loraplex.errors import LoraplexError
from loraplex.types import LoRARequest

logger = logging.getLogger("loraplex")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="model directory, or a bundled config: " + ", ".join(BUNDLED_CONFIGS))
    # vllm bench serve's names are accepted too: --dataset-name, --random-input-len, ...
    p.add_argument("--dataset-name", default="random", choices=["random", "prefix_repetition"])
    p.add_argument("--prefix-repetition-prefix-len", type=at_least(1), default=256,
                   help="prefix_repetition: tokens of the prefix prompts share")
    p.add_argument("--prefix-repetition-suffix-len", type=at_least(1), default=256,
                   help="prefix_repetition: tokens of each prompt's own after it")
    p.add_argument("--prefix-repetition-num-prefixes", type=at_least(1), default=None,
                   help="prefix_repetition: distinct prefixes (default: one per adapter; the "
                        "requests of an adapter share its prefix)")
    p.add_argument("--prefix-repetition-output-len", type=at_least(1), default=128)
    p.add_argument("--num-prompts", type=at_least(1), default=512)
    p.add_argument("--input-len", "--random-input-len", dest="input_len", type=at_least(1), default=512)
    p.add_argument("--output-len", "--random-output-len", dest="output_len", type=at_least(1),
                   default=128)
    p.add_argument("--max-concurrency", type=at_least(1), default=32)
    p.add_argument("--num-adapters", type=at_least(0), nargs="+", default=[0],
                   help="in process: one run per value, over that many adapters the bench "
                        "creates; 0 = base model")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME",
                   help="with --base-url: the server's adapters; each request names one "
                        "(picked per --adapter-dist)")
    p.add_argument("--adapter-dist", nargs="+", default=["uniform"], choices=["uniform", "zipf"])
    p.add_argument("--cold-adapters", action="store_true",
                   help="adapters start on disk: nothing pre-loaded into host memory or GPU slots")
    p.add_argument("--adapter-registry", action="store_true",
                   help="publish the adapters to a registry (hard links) and request them by name")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lora-targets", nargs="+", default=list(LINEAR_TARGETS),
                   help="module names; 'experts' adds every expert's gate_up and down (MoE)")
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "loraplex" / "bench"))
    p.add_argument("--base-url", default=None, help="drive this OpenAI-compatible server instead")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--result-json", default=None)
    p.add_argument("--plot", default=None, metavar="PNG")
    p.add_argument("--sample-stacks", action="store_true",
                   help="in process: sample where the engine thread spends its host time in "
                        "runner.launch (reported per run; the sampler thread takes the GIL, so "
                        "host-bound runs slow down: leave it off for throughput figures)")
    EngineArgs.add_cli_args(p)
    # The in-process engine's defaults for benchmarking; None: sized from the workload.
    p.set_defaults(dtype="bfloat16", lora_load_workers=8, measure_moe_routing=True, max_loras=None,
                   max_lora_rank=None, max_num_seqs=None)
    p.epilog = ("Engine arguments left at None are sized from the workload: --max-loras the "
                "largest --num-adapters (at most 32 with --cold-adapters), --max-lora-rank "
                "--lora-rank, --max-cpu-loras every adapter (4 x --max-loras with "
                "--cold-adapters), --max-num-seqs --max-concurrency, --max-model-len input + "
                "output + 16. --seed also draws the workloads.")


def main(args: argparse.Namespace) -> int:
    _check_args(args)
    if args.dataset_name == "prefix_repetition":  # vLLM's flags, in terms of the random workload's
        args.input_len = args.prefix_repetition_prefix_len + args.prefix_repetition_suffix_len
        args.output_len = args.prefix_repetition_output_len
    args.prefix_len = args.prefix_repetition_prefix_len if args.dataset_name == "prefix_repetition" else 0
    cache = Path(args.cache_dir)
    model_dir, dummy = prepare_model_dir(args.model, cache)
    results = []
    if args.base_url:
        vocab = _vocab_size(model_dir)
        for k, dist in _runs(args):
            reqs = make_requests(args.num_prompts, args.input_len, args.output_len, vocab, k,
                                 dist, args.seed, args.prefix_len, args.prefix_repetition_num_prefixes)
            records = run_http(args.base_url, args.served_model_name or str(args.model), reqs,
                               args.lora_modules or [], args.max_concurrency, args.api_key)
            results.append(_summarize(_label(args, k, dist), records))
    else:
        results = _run_in_process(args, model_dir, dummy)
    print(format_table(results))
    base = next((r for r in results if r.label.endswith(" base")), None)
    for r in results:
        if base is not None and r is not base and base.output_throughput and base.ttft_ms.get("p99"):
            tpot = r.tpot_ms.get("median", 0) / max(base.tpot_ms.get("median", 0), 1e-9)
            print(f"{r.label}: {r.output_throughput / base.output_throughput:.2f} x base throughput, "
                  f"TTFT p99 {r.ttft_ms.get('p99', 0) / base.ttft_ms['p99']:.2f} x base, "
                  f"TPOT median {tpot:.2f} x base")
        if r.extra.get("steps"):
            print(f"{r.label}: engine steps {r.extra['steps']}")
        if "spec_proposed_tokens" in r.extra:
            kept = (f", {r.extra['spec_acceptance_rate']:.1%} of them kept, "
                    f"{r.extra['spec_mean_accepted_length']:.2f} tokens per verified step"
                    if "spec_acceptance_rate" in r.extra else "")
            print(f"{r.label}: speculation: {r.extra['spec_proposed_tokens']} tokens proposed{kept}")
        if "prefix_cache_hit_rate" in r.extra:
            print(f"{r.label}: {r.extra['prefix_cache_hit_rate']:.1%} of prompt tokens from the prefix cache")
        if "adapter_tiers" in r.extra:
            load = r.extra.get("adapter_load_ms", {})
            print(f"{r.label}: adapter tiers {r.extra['adapter_tiers']}, load ms median "
                  f"{load.get('median', 0):.1f} p99 {load.get('p99', 0):.1f}")
        if "pinned_allocs" in r.extra:
            print(f"{r.label}: page-locked allocations while timed {r.extra['pinned_allocs']}")
        if "launch_stacks" in r.extra:
            st = r.extra["launch_stacks"]
            print(f"{r.label}: runner.launch in {st['inside']} of {st['samples']} stack samples, "
                  f"thread states {st['states']}; most sampled:")
            for row in st["top"][:12]:
                print(f"  {row['count']:6d} {row['state']} {row['loraplex']} | {row['innermost']}")
        if "moe_experts_per_layer_decode" in r.extra:
            print(f"{r.label}: a decode step touches {r.extra['moe_experts_per_layer_decode']:.1f} "
                  "distinct experts per MoE layer (mean)")
    if args.result_json:
        Path(args.result_json).write_text(to_json(results))
    if args.plot:
        plot(results, args.plot)
    return 0


def _check_args(args) -> None:
    """Fail on what the runs could not honour before any of them starts."""
    if args.plot:
        require_matplotlib()
    if args.base_url and any(args.num_adapters):
        raise LoraplexError("--num-adapters creates adapters in this process; with --base-url "
                            "name the server's adapters: --lora-modules NAME [NAME ...]")
    if args.lora_modules and not args.base_url:
        raise LoraplexError("--lora-modules names a server's adapters (with --base-url); in "
                            "process --num-adapters K creates K adapters")


def _runs(args) -> list[tuple[int, str]]:
    counts = [len(args.lora_modules)] if args.lora_modules else args.num_adapters
    return [(k, d) for k in counts for d in (args.adapter_dist if k else ["none"])]


def _summarize(label: str, records, extra: dict | None = None):
    """summarize(), refusing a run whose every request failed (its table would be nan)."""
    result = summarize(label, records, extra)
    if result.num_failed == result.num_requests:
        first = next((r.error for r in records if r.error), "no output tokens")
        raise LoraplexError(f"{label}: all {result.num_requests} requests failed; the first: {first}")
    return result


def _label(args, k: int, dist: str) -> str:
    cold = ", cold" if args.cold_adapters and k else ""
    who = "base" if k == 0 else f"{k} adapters ({dist}{cold})"
    shared = f" (prefix {args.prefix_len})" if getattr(args, "prefix_len", 0) else ""
    quant = f" {args.quantization}" if getattr(args, "quantization", None) else ""
    acts = getattr(args, "fp8_activations", "unquantized")
    if quant and acts != "unquantized":
        quant += " w8a8" if acts == "dynamic" else f" w8a8-{acts}"
    return f"{args.model}{quant} {args.input_len}{shared}/{args.output_len} c{args.max_concurrency} {who}"


def _vocab_size(model_dir: Path) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir).vocab_size


def _run_in_process(args, model_dir: Path, dummy: bool):
    max_k = max(args.num_adapters)
    max_loras = args.max_loras or max(1, min(max_k, 32 if args.cold_adapters else max_k))
    registry = Path(args.cache_dir) / "registry" if args.adapter_registry else None
    engine = replace(
        EngineArgs.from_cli_args(args), model=str(model_dir),
        load_format="dummy" if dummy else args.load_format,
        lora_registry=str(registry) if registry else args.lora_registry, max_loras=max_loras,
        max_lora_rank=args.max_lora_rank or args.lora_rank,
        max_cpu_loras=args.max_cpu_loras or (4 * max_loras if args.cold_adapters else max(max_k, 1)),
        max_num_seqs=args.max_num_seqs or args.max_concurrency,
        max_model_len=args.max_model_len or args.input_len + args.output_len + 16,
    ).create_engine()
    vocab = engine.config.model.vocab_size
    workloads = {(k, d): make_requests(args.num_prompts, args.input_len, args.output_len, vocab, k, d,
                                       args.seed, args.prefix_len, args.prefix_repetition_num_prefixes)
                 for k, d in _runs(args)}
    adapters, warm = [], []
    if max_k:
        shapes = dict(engine.runner.adapter_targets.projections)
        experts = dict(engine.runner.adapter_targets.experts)
        t0 = time.perf_counter()
        used = sorted({r.adapter for reqs in workloads.values() for r in reqs if r.adapter is not None})
        used = used if args.cold_adapters else range(max_k)
        paths = prepare_adapters(cache_dir=Path(args.cache_dir), model_name=Path(model_dir).name,
                                 projections=shapes, indices=list(used), rank=args.lora_rank,
                                 targets=tuple(args.lora_targets), experts=experts)
        if registry:
            _publish(registry, {f"bench-adapter-{i}": p for i, p in paths.items()})
        adapters = [LoRARequest(f"bench-adapter-{i}", i + 1, "" if registry else str(paths[i]))
                    if i in paths else None for i in range(max_k)]
        if args.cold_adapters:  # warm up on other adapters; the timed ones stay on disk
            n = min(max_loras, max_k)
            warm_paths = prepare_adapters(cache_dir=Path(args.cache_dir), model_name=Path(model_dir).name,
                                          projections=shapes, indices=list(range(10**6, 10**6 + n)),
                                          rank=args.lora_rank, targets=tuple(args.lora_targets),
                                          experts=experts)
            if registry:
                _publish(registry, {f"warm-{i}": p for i, p in warm_paths.items()})
            warm = [LoRARequest(f"warm-{i}", 10**6 + i, "" if registry else str(p))
                    for i, p in warm_paths.items()]
        else:
            warm = adapters
            for lora in adapters:
                engine.load_adapter(lora)
        logger.info("%d adapters ready in %.1f s", len(paths), time.perf_counter() - t0)

    _warm_up(engine, warm, args)
    results = []
    for (k, dist), reqs in workloads.items():
        steps_before, stats_before = engine.num_steps, engine.stats()
        engine.runner.reset_moe_routing_stats()
        engine.step_timings = []
        sampler = StackSampler(threading.current_thread()) if args.sample_stacks else nullcontext()
        pinned_before = pinned_allocs()
        with compiled_kernels() as compiled, sampler:
            records = run_in_process(engine, reqs, adapters[:k], args.max_concurrency)
            engine.runner.synchronize()  # every logged step's device events have fired
        stats = engine.stats()
        extra = {"engine_steps": engine.num_steps - steps_before, **stats,
                 "steps": step_profile(engine.step_timings), "compiled_while_timed": compiled}
        queried = stats["prefix_cache_queried_tokens"] - stats_before["prefix_cache_queried_tokens"]
        if queried:  # this run's prompt tokens found in the prefix cache
            extra["prefix_cache_hit_rate"] = round(
                (stats["prefix_cache_hit_tokens"] - stats_before["prefix_cache_hit_tokens"]) / queried, 4)
        drafted = stats["spec_draft_tokens"] - stats_before["spec_draft_tokens"]
        if engine.config.speculative is not None:  # this run's proposals (none where nothing matched)
            extra["spec_proposed_tokens"] = drafted
        if drafted:  # speculation: the share of proposals kept, tokens per verified step
            accepted = stats["spec_accepted_tokens"] - stats_before["spec_accepted_tokens"]
            verified = stats["spec_verified_chunks"] - stats_before["spec_verified_chunks"]
            extra["spec_acceptance_rate"] = round(accepted / drafted, 4)
            extra["spec_mean_accepted_length"] = round(1 + accepted / verified, 3)
        if pinned_before is not None:  # cudaHostAlloc/Free calls: each holds a driver lock
            extra["pinned_allocs"] = {k: round(v - pinned_before[k], 1) for k, v in pinned_allocs().items()}
        if args.sample_stacks:
            extra["launch_stacks"] = sampler.report()
        engine.step_timings = None
        if compiled:
            short = [c[:120] + " ..." + c[c.rfind(" called from "):] for c in compiled]
            logger.warning("%d Triton kernel variants were compiled during the timed run (the warm-up "
                           "missed them; each stalls the engine; in full in the JSON): %s",
                           len(compiled), short)
        results.append(_summarize(_label(args, k, dist), records, extra))
        logger.info("%s", format_table(results[-1:]))
    return results


def _publish(root: Path, adapters: dict[str, Path]) -> None:
    """Publish adapter directories under their names (hard links: no copies)."""
    from concurrent.futures import ThreadPoolExecutor

    from loraplex.adapters.registry import Registry

    registry = Registry(str(root))
    todo = {n: p for n, p in adapters.items() if not registry.index(n)["versions"]}
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda item: registry.publish(*item, link=True, owner=None), todo.items()))


def _warm_up(engine, adapters: list[LoRARequest], args) -> None:
    """Compile every kernel variant and load each adapter into a GPU slot, untimed."""
    t0 = time.perf_counter()
    n = max(args.max_concurrency, len(adapters), 1)
    vocab = engine.config.model.vocab_size
    # Varied tokens, as in the timed prompts: an MoE then routes them over many experts
    # (a prompt of one repeated token sends all its tokens to the same few).
    prompts = [[vocab // 4 + (i * 7919 + j * 104729) % (vocab // 2) for j in range(args.input_len)]
               for i in range(n)]
    batches = [[BenchRequest(p, 4, i % len(adapters) if adapters and i % 2 else None)
                for i, p in enumerate(prompts)]]
    if adapters:  # all adapters, then none: a step without adapter tokens runs other kernel
        # variants (no adapter delta in the MoE GEMMs), and the base run's steps are all such
        batches.append([BenchRequest(p, 4, i) for i, p in enumerate(prompts[: len(adapters)])])
        batches.append([BenchRequest(p, 4, None) for p in prompts])
    for batch in batches:  # every request at once
        failed = [r.error for r in run_in_process(engine, batch, adapters, len(batch)) if r.error]
        if failed:
            raise LoraplexError(f"warm-up: {len(failed)} of {len(batch)} requests failed; the first: "
                                f"{failed[0]}")
    logger.info("warm-up done in %.1f s", time.perf_counter() - t0)
