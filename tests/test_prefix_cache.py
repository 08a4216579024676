"""Automatic prefix caching: full KV pages are reused by later requests with the same
prefix under the same adapter content (never across adapters, whatever their names,
nor across salts), and every answer equals the one computed without the cache."""

from __future__ import annotations

import pytest
from conftest import ADAPTERS, DTYPE, assert_same_greedy_tokens, batch_tolerance, make_llm, make_peft_adapter

from loraplex import LoRARequest, SamplingParams

SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
PREFIX = [5 + (i * 7) % 300 for i in range(40)]  # 2.5 pages of 16: two full pages to share


def _close(a, b):
    assert_same_greedy_tokens(a.outputs[0], b.outputs[0])
    if DTYPE == "float32":
        for x, y, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
            assert abs(x[t].logprob - y[t].logprob) <= batch_tolerance()


@pytest.fixture(scope="module")
def adapters(model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("pc-adapters")
    return [make_peft_adapter(model_dirs["qwen3"], root / f"a{i}", seed=10 + i, **ADAPTERS["all7-r8"])
            for i in range(2)]


def test_a_warm_prefix_gives_the_cold_answer(model_dirs):
    cold = make_llm(model_dirs["qwen3"], enable_prefix_caching=False)
    warm = make_llm(model_dirs["qwen3"])
    prompts = [PREFIX + [301, 302], PREFIX + [303, 304, 305]]
    want = cold.generate(prompts, SP, use_tqdm=False)
    first = warm.generate(prompts[:1], SP, use_tqdm=False)[0]
    second = warm.generate(prompts[1:], SP, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 32
    _close(first, want[0])
    _close(second, want[1])
    again = warm.generate(prompts[:1], SP, use_tqdm=False)[0]  # a whole prompt cached but its last token
    assert again.num_cached_tokens == 32
    _close(again, want[0])
    stats = warm.engine.stats()
    assert stats["prefix_cache_hit_tokens"] == 64 and stats["prefix_cache_queried_tokens"] > 64


def test_adapters_share_pages_by_content_not_name(model_dirs, adapters):
    llm = make_llm(model_dirs["qwen3"])
    fresh = make_llm(model_dirs["qwen3"], enable_prefix_caching=False)
    a, a_again, b = (LoRARequest("a", 1, str(adapters[0])), LoRARequest("a-copy", 2, str(adapters[0])),
                     LoRARequest("b", 3, str(adapters[1])))
    prompt = PREFIX + [310]
    llm.generate([prompt], SP, a, use_tqdm=False)
    base, other, same = (llm.generate([prompt], SP, lora, use_tqdm=False)[0] for lora in (None, b, a_again))
    assert base.num_cached_tokens == 0, "the base model never reads an adapter's pages"
    assert other.num_cached_tokens == 0, "another adapter never reads them"
    assert same.num_cached_tokens == 32, "the same adapter under another name does"
    for out, lora in ((base, None), (other, b), (same, a_again)):
        _close(out, fresh.generate([prompt], SP, lora, use_tqdm=False)[0])


def test_salts_keep_pages_apart(model_dirs):
    engine = make_llm(model_dirs["qwen3"]).engine
    outs = {}
    for request_id, salt in (("a", "acme"), ("b", "globex"), ("c", "acme")):
        engine.add_request(request_id, PREFIX + [320], SP, cache_salt=salt)
        while engine.has_unfinished_requests():
            for out in engine.step():
                outs[out.request_id] = out
    assert [outs[r].num_cached_tokens for r in "abc"] == [0, 0, 32]


def test_eviction_and_preemption_under_page_pressure_keep_every_answer(model_dirs, adapters):
    """A cache of 24 pages, 24 requests over 3 shared prefixes and 2 adapters: pages are
    evicted, reused and preempted constantly; every answer equals the cache-less one."""
    loras = [None, LoRARequest("a", 1, str(adapters[0])), LoRARequest("b", 2, str(adapters[1]))]
    prefixes = [[7 + (i * j) % 250 for i in range(33)] for j in (3, 5, 11)]
    prompts = [prefixes[i % 3] + [340 + i] for i in range(24)]
    per_prompt = [loras[(i // 3) % 3] for i in range(24)]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=5)
    want = make_llm(model_dirs["qwen3"], enable_prefix_caching=False).generate(prompts, sp, per_prompt,
                                                                                use_tqdm=False)
    llm = make_llm(model_dirs["qwen3"], num_gpu_blocks_override=24, max_model_len=64, max_num_seqs=8)
    got = llm.generate(prompts, sp, per_prompt, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in got) > 0
    assert sum(o.metrics.num_preemptions for o in got) > 0
    for g, w in zip(got, want):
        _close(g, w)
