"""The rest of the sampling surface through the engine and the server: penalties,
logit_bias and min_p (the sampler's formulas: tests/test_sampler.py)."""

from __future__ import annotations

import pytest
from conftest import make_llm

from loraplex import SamplingParams


@pytest.fixture(scope="module")
def llm(model_dirs):
    return make_llm(model_dirs["qwen3"])


def test_penalties_see_the_token_in_flight(model_dirs, llm):
    """With async scheduling the token sampled by the step in flight is counted from the
    device: the same tokens as stepping one step at a time."""
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=1.5,
                        presence_penalty=0.5, repetition_penalty=1.3)
    prompts = [[5, 6, 7, 8], [9, 9, 9]]
    serial = make_llm(model_dirs["qwen3"], async_scheduling=False).generate(prompts, sp, use_tqdm=False)
    overlapped = llm.generate(prompts, sp, use_tqdm=False)
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                         use_tqdm=False)
    for a, b, c in zip(serial, overlapped, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].token_ids != c.outputs[0].token_ids, "the penalties changed something"


def test_logit_bias_and_min_p(llm):
    out = llm.generate([[5, 6]], SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True,
                                               logit_bias={17: 100.0}, seed=1), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [17] * 8
    banned = llm.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                  logit_bias={t: -100.0 for t in range(3, 384)}),
                          use_tqdm=False)[0]
    assert set(banned.outputs[0].token_ids) <= {0, 1, 2}
    greedy = llm.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                          use_tqdm=False)
    tight = llm.generate([[5, 6]], SamplingParams(temperature=1.0, min_p=1.0, max_tokens=6, ignore_eos=True,
                                                 seed=3), use_tqdm=False)
    assert tight[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids, "min_p 1 keeps the argmax"


@pytest.mark.parametrize("bad", [
    dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repetition_penalty=0), dict(min_p=1.5),
    dict(logit_bias={5: 101.0}), dict(logit_bias={100000: 1.0})])
def test_bad_values_are_refused(llm, bad):
    from loraplex.errors import InvalidRequest

    with pytest.raises(InvalidRequest):
        llm.engine.add_request("bad", [5, 6], SamplingParams(**bad))


def test_n_samples_equal_single_requests_with_their_seeds(llm):
    """n = 4 seeded: sample i is the request with seed + i alone, and the samples after
    the first read the prompt's pages from the cache."""
    prompt = [5 + (i * 7) % 300 for i in range(40)]
    sp = SamplingParams(temperature=1.0, top_k=20, max_tokens=8, ignore_eos=True, seed=100, n=4, logprobs=1)
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3] and out.finished
    assert out.num_cached_tokens == 32
    for i, c in enumerate(out.outputs):
        alone = SamplingParams(temperature=1.0, top_k=20, max_tokens=8, ignore_eos=True, seed=100 + i,
                               logprobs=1)
        single = llm.generate([prompt], alone, use_tqdm=False)[0]
        assert c.token_ids == single.outputs[0].token_ids, i
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_best_of_returns_the_most_likely_candidates(llm):
    sp = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=7, n=2, best_of=5)
    out = llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0]
    every = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=7, n=5, logprobs=0)
    candidates = llm.generate([[5, 6, 7]], every, use_tqdm=False)[0].outputs
    best = sorted(candidates, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in best]
    assert out.outputs[0].logprobs is None, "logprobs only where asked"
