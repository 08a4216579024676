"""Benchmark workloads in the manner of `vllm bench serve --dataset-name random` (and
`prefix_repetition`).

N prompts of exactly `input_len` tokens (random ids; with the word tokenizer the text
`t<i> t<j> ...` encodes to exactly those ids), each asking for `output_len` tokens with
ignore_eos, each assigned an adapter: uniformly or Zipf over K adapters, or none; with a
shared prefix, the prompts of one adapter begin alike.
Also prepares what a run needs: a model directory (a real one, or a bundled config with
a word tokenizer for dummy weights) and K random PEFT adapters.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from loraplex.bench.synthetic import LINEAR_TARGETS, write_random_adapter, write_word_tokenizer
from loraplex.errors import ModelLoadError

BUNDLED_CONFIGS = ("llama-3.1-8b", "llama-3.1-70b", "qwen3-8b", "qwen3-0.6b", "qwen3-30b-a3b", "gpt-oss-20b",
                   "deepseek-v2-lite")
MOE_CONFIGS = ("qwen3-30b-a3b", "gpt-oss-20b", "deepseek-v2-lite")  # those `loraplex tune` takes


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int
    adapter: int | None  # index into the adapter list, None: base model


def make_requests(
    num_prompts: int, input_len: int, output_len: int, vocab_size: int,
    num_adapters: int, distribution: str, seed: int, prefix_len: int = 0, num_prefixes: int | None = None,
) -> list[BenchRequest]:
    """`prefix_len` > 0: vLLM's prefix_repetition, shaped for adapters: each prompt starts
    with one of `num_prefixes` shared prefixes (default: one per adapter, each adapter's
    requests sharing its own, as tenants send one system prompt with every request; base
    requests take them in turn), then input_len - prefix_len tokens of its own."""
    rng = np.random.default_rng(seed)
    if num_adapters == 0 or distribution == "none":
        picks = [None] * num_prompts
    elif distribution == "uniform":
        picks = rng.integers(0, num_adapters, num_prompts).tolist()
    elif distribution == "zipf":  # P(adapter k) ~ 1 / (k + 1)
        weights = 1.0 / np.arange(1, num_adapters + 1)
        picks = rng.choice(num_adapters, num_prompts, p=weights / weights.sum()).tolist()
    else:
        raise ValueError(f"unknown adapter distribution {distribution!r}; known: uniform, zipf, none")
    # Skip the lowest ids, where special tokens usually sit.
    low = min(1000, vocab_size // 4)
    prompts = rng.integers(low, vocab_size, (num_prompts, input_len - prefix_len)).tolist()
    if prefix_len:
        if not 0 < prefix_len < input_len:
            raise ValueError(f"a shared prefix of {prefix_len} tokens needs prompts longer than it")
        n = num_prefixes or max(num_adapters, 1)
        prefixes = rng.integers(low, vocab_size, (n, prefix_len)).tolist()
        prompts = [prefixes[(a if a is not None else j) % n] + p
                   for j, (p, a) in enumerate(zip(prompts, picks))]
    return [BenchRequest(p, output_len, a) for p, a in zip(prompts, picks)]


def prepare_model_dir(model: str, cache_dir: Path) -> tuple[Path, bool]:
    """A model directory for `model`: a path as is, or a bundled config name -> a directory
    with that config.json and a word tokenizer (weights: dummy). Returns (dir, is_dummy)."""
    if Path(model).is_dir():
        if not (Path(model) / "config.json").is_file():
            raise ModelLoadError(f"{model}: not a model directory (no config.json)")
        return Path(model), not any(Path(model).glob("*.safetensors"))
    if model not in BUNDLED_CONFIGS:
        known = ", ".join(BUNDLED_CONFIGS)
        raise ModelLoadError(f"{model!r} is neither a directory nor a bundled config ({known})")
    out = cache_dir / model
    if not (out / "tokenizer.json").is_file():
        out.mkdir(parents=True, exist_ok=True)
        src = resources.files("loraplex.bench") / "configs" / model / "config.json"
        with resources.as_file(src) as f:
            shutil.copy(f, out / "config.json")
        config = json.loads((out / "config.json").read_text())
        write_word_tokenizer(out, config["vocab_size"])
    return out, True


def random_adapter_requests(engine, model_dir: str | Path, cache_dir: Path, count: int, rank: int = 16,
                            targets: tuple[str, ...] = LINEAR_TARGETS) -> list:
    """LoRARequests a0..a{count-1} for random adapters (prepare_adapters) that fit the
    engine's model: its projections, and its experts when `targets` names them."""
    from loraplex.types import LoRARequest

    fits = engine.runner.adapter_targets
    paths = prepare_adapters(cache_dir, Path(model_dir).name, dict(fits.projections),
                             list(range(count)), rank, targets, experts=dict(fits.experts))
    return [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in paths.items()]


def prepare_adapters(
    cache_dir: Path, model_name: str, projections: dict[str, tuple[int, int]], indices: list[int],
    rank: int, targets: tuple[str, ...] = LINEAR_TARGETS, experts: dict | None = None,
) -> dict[int, Path]:
    """Random bf16 PEFT adapters number `indices` (A ~ N(0, 1/in), B ~ N(0, 1e-4); adapter
    i is seeded by i), cached on disk."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    root = cache_dir / f"{model_name}-adapters-r{rank}-{'-'.join(sorted(targets))}"
    paths = {i: root / f"adapter-{i}" for i in indices}
    missing = [i for i, p in paths.items() if not (p / "adapter_model.safetensors").is_file()]
    with ThreadPoolExecutor(8) as pool:  # torch and safetensors release the GIL
        list(pool.map(lambda i: write_random_adapter(paths[i], projections, rank, targets=targets,
                                                     b_std=1e-4, seed=i, dtype=torch.bfloat16,
                                                     experts=experts),
                      missing))
    return paths
