"""loraplex vs transformers + PEFT: prompt logprobs, generated-token logprobs and greedy
tokens, for every dense architecture, the base model and three different adapters, all
served in one mixed batch."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    ADAPTERS,
    ARCHS,
    DTYPE,
    HFOracle,
    assert_same_greedy_tokens,
    batch_tolerance,
    make_llm,
    random_prompts,
    tolerance,
)

from loraplex import LoRARequest, SamplingParams

NUM_NEW = 8


def _logprobs_of(positions, token_ids) -> torch.Tensor:
    return torch.tensor([pos[t].logprob for pos, t in zip(positions, token_ids)])


CASES = [(arch, "auto") for arch in ARCHS] + [
    ("qwen3", "triton"), ("mistral", "triton"), ("gemma3", "triton")
]


@pytest.mark.parametrize("arch,backend", CASES)
def test_mixed_batch_matches_hf_and_peft(arch, backend, model_dirs, adapter_dirs):
    """On CPU, "auto" is the torch reference and "triton" runs the kernels interpreted."""
    llm = make_llm(model_dirs[arch], ops_backend=backend)
    prompts = random_prompts(3, (14, 40), seed=1)  # longer than mistral's window of 12
    variants = [None] + [
        LoRARequest(name, i + 1, str(adapter_dirs[arch][name])) for i, name in enumerate(ADAPTERS)
    ]
    batch = [(p, v) for p in prompts for v in variants]
    sp = SamplingParams(
        temperature=0, max_tokens=NUM_NEW, ignore_eos=True, prompt_logprobs=0, logprobs=0
    )
    outs = llm.generate([p for p, _ in batch], sp, [v for _, v in batch])

    tol = tolerance()
    for variant in variants:
        adapter_dir = None if variant is None else variant.lora_path
        oracle = HFOracle(model_dirs[arch], adapter_dir)
        for (prompt, v), out in zip(batch, outs):
            if v is not variant:
                continue
            what = f"{arch} / {variant.lora_name if variant else 'base'}"
            assert out.prompt_logprobs[0] is None
            got = _logprobs_of(out.prompt_logprobs[1:], prompt[1:])
            diff = (got - oracle.prompt_logprobs(prompt)).abs().max().item()
            assert diff <= tol, f"{what}: prompt logprobs differ by {diff}"

            tokens = out.outputs[0].token_ids
            assert len(tokens) == NUM_NEW
            # Teacher-forced: HF scores loraplex's tokens, which must be HF's best choice.
            ref = oracle.logits(prompt + tokens)[len(prompt) - 1 : -1].log_softmax(-1)
            chosen = ref[torch.arange(NUM_NEW), torch.tensor(tokens)]
            gen_diff = (_logprobs_of(out.outputs[0].logprobs, tokens) - chosen).abs().max().item()
            assert gen_diff <= tol, f"{what}: generated-token logprobs differ by {gen_diff}"
            if DTYPE == "float32":
                assert tokens == oracle.greedy(prompt, NUM_NEW), what
            else:  # bf16 may break near-ties differently: each pick must be near-best
                gap = (ref.max(-1).values - chosen).max().item()
                assert gap <= tol, f"{what}: picked a token {gap} below HF's best"


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_each_request_gets_what_it_gets_alone(arch, model_dirs, adapter_dirs):
    llm = make_llm(model_dirs[arch])
    prompts = random_prompts(8, (5, 30), seed=2)
    variants = [None] + [
        LoRARequest(name, i + 1, str(adapter_dirs[arch][name])) for i, name in enumerate(ADAPTERS)
    ]
    loras = [variants[i % len(variants)] for i in range(len(prompts))]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=0,
                        logprobs=5)
    together = llm.generate(prompts, sp, loras)
    for prompt, lora, out in zip(prompts, loras, together):
        alone = llm.generate([prompt], sp, lora)[0]
        assert_same_greedy_tokens(out.outputs[0], alone.outputs[0])
        a = _logprobs_of(out.prompt_logprobs[1:], prompt[1:])
        b = _logprobs_of(alone.prompt_logprobs[1:], prompt[1:])
        assert (a - b).abs().max().item() <= batch_tolerance()


def test_base_requests_are_bit_identical_beside_adapters(model_dirs, adapter_dirs):
    llm = make_llm(model_dirs["qwen2"])
    prompts = random_prompts(8, (20, 21), seed=3)  # equal lengths: the same schedule
    adapters = [
        LoRARequest(name, i + 1, str(adapter_dirs["qwen2"][name])) for i, name in enumerate(ADAPTERS)
    ]
    mixed = [None if i % 2 == 0 else adapters[i // 2 % 3] for i in range(len(prompts))]
    for lora in adapters:  # in memory before the batch starts: both runs get one schedule
        llm.engine.load_adapter(lora)
    sp = SamplingParams(
        temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=3, logprobs=3
    )
    with_adapters = llm.generate(prompts, sp, mixed)
    base_only = llm.generate(prompts, sp, None)
    assert any(
        a.outputs[0].token_ids != b.outputs[0].token_ids
        for a, b, lora in zip(with_adapters, base_only, mixed)
        if lora is not None
    ), "adapters should change some outputs"
    for a, b, lora in zip(with_adapters, base_only, mixed):
        if lora is None:
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert a.prompt_logprobs == b.prompt_logprobs  # exact float equality
            assert a.outputs[0].logprobs == b.outputs[0].logprobs
