"""Speculative decoding's parts: vLLM's --speculative-config, the n-gram proposer
(engine/speculative.py) and the verification sampler (runner/rejection.py), whose
output must have the target model's distribution whatever was proposed."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ARCHS, DTYPE, assert_same_greedy_tokens, make_llm, random_prompts
from quantized import write_tiny_qwen3_moe
from speculation import AlwaysSeen, repeat_last_on_device

from loraplex import LoRARequest, SamplingParams, ops
from loraplex.config import SpeculativeConfig
from loraplex.engine.speculative import PROBE_PERIOD, SeenSuffix, draft_length, propose_ngram
from loraplex.errors import InvalidRequest
from loraplex.runner.rejection import Verified, rejection_sample

# -- configuration -------------------------------------------------------------------------


def test_config_parses_vllm_json():
    spec = '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "prompt_lookup_min": 2}'
    assert SpeculativeConfig.parse(spec) == SpeculativeConfig("ngram", 5, 3, 2)
    parsed = SpeculativeConfig.parse({"num_speculative_tokens": 2})
    assert parsed == SpeculativeConfig(num_speculative_tokens=2)
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None
    draft = SpeculativeConfig.parse('{"model": "/models/small", "num_speculative_tokens": 4}')
    assert draft.method == "draft_model" and draft.model == "/models/small"


@pytest.mark.parametrize("spec,error", [
    ("{not json", "not JSON"),
    ("[1]", "JSON object"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method 'eagle'"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"num_speculative_tokens": 0}, "positive integer"),
    ({"num_speculative_tokens": True}, "positive integer"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "exceeds"),
    ({"num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "unsupported keys"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs \"model\""),
    ({"model": "/m", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "apply to ngram"),
    ({"method": "ngram", "model": "/m", "num_speculative_tokens": 2}, "applies to draft_model"),
    ({"num_speculative_tokens": 2, "draft_adapters": {"a": "/d"}}, "applies to draft_model"),
    ({"model": "/m", "num_speculative_tokens": 2, "draft_adapters": ["/d"]}, "draft_adapters maps"),
    ({"model": "/m", "num_speculative_tokens": 2, "draft_adapters": {"a": ""}}, "draft_adapters maps"),
])
def test_config_refuses_what_it_cannot_honour(spec, error):
    with pytest.raises(InvalidRequest, match=error):
        SpeculativeConfig.parse(spec)


def test_proposal_length_follows_acceptance():
    assert draft_length(4, 1.0) == 4 and draft_length(4, 0.5) == 4
    assert draft_length(4, 0.3) == 2 and draft_length(1, 0.3) == 1
    assert draft_length(4, 0.1) == 0 and draft_length(4, 0.1, probe=True) == 1  # probes keep measuring
    parsed = SpeculativeConfig.parse({"num_speculative_tokens": 2, "disable_by_batch_size": 8})
    assert parsed.disable_by_batch_size == 8


# -- the n-gram proposer ---------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_suffix():
    assert propose_ngram([1, 2, 3, 4, 1, 2], k=3, n_min=1, n_max=4) == [3, 4, 1]
    assert propose_ngram([1, 2, 3, 4, 1, 2], k=1, n_min=1, n_max=4) == [3]
    assert propose_ngram([5, 6, 7], k=3, n_min=1, n_max=4) == []  # no earlier occurrence
    assert propose_ngram([9], k=3, n_min=1, n_max=4) == []
    # Fewer than k left after the occurrence: the sequence repeats with its period.
    assert propose_ngram([1, 2, 3, 1, 2], k=5, n_min=1, n_max=2) == [3, 1, 2, 3, 1]
    assert propose_ngram([4, 7, 7, 7], k=4, n_min=1, n_max=4) == [7, 7, 7, 7]


def test_ngram_prefers_the_longest_suffix_then_the_latest_occurrence():
    # Last token 7: its latest earlier occurrence is followed by 0, but the 2-gram (3, 7)
    # occurred earlier, followed by 8.
    tokens = [3, 7, 8, 1, 7, 0, 5, 3, 7]
    assert propose_ngram(tokens, k=1, n_min=1, n_max=2) == [8]
    assert propose_ngram(tokens, k=1, n_min=1, n_max=1) == [0]
    assert propose_ngram(tokens, k=1, n_min=2, n_max=2) == [8]
    assert propose_ngram([4, 4, 4, 4], k=2, n_min=1, n_max=3) == [4, 4]  # overlapping runs


def test_seen_suffix_says_whether_the_search_proposes():
    """SeenSuffix (the scheduler's test for proposals made on the device) is true exactly
    where propose_ngram proposes something, for any n_max, as tokens arrive."""
    gen = torch.Generator().manual_seed(6)
    hits = 0
    for trial in range(60):
        n_min = 1 + trial % 3
        seen = SeenSuffix(n_min)
        prompt = torch.randint(0, 2 + trial % 8, (1 + trial % 7,), generator=gen).tolist()
        output = []
        while len(output) < 60:
            want = bool(propose_ngram(prompt + output, 1, n_min, n_min + trial % 4))
            assert seen.matches(prompt, output) == want, (prompt, output, n_min)
            hits += want
            output += torch.randint(0, 2 + trial % 8, (1 + len(output) % 4,), generator=gen).tolist()
    assert hits > 100


# -- verification ----------------------------------------------------------------------------


def _one_hot_probs(argmaxes: list[list[int]], vocab: int) -> torch.Tensor:
    probs = torch.full((len(argmaxes), len(argmaxes[0]), vocab), 0.1 / vocab)
    for s, row in enumerate(argmaxes):
        for j, t in enumerate(row):
            probs[s, j, t] += 0.9
    return probs


def _verify_greedy(how: str, probs: torch.Tensor, drafts: torch.Tensor, num: torch.Tensor):
    """Greedy rows through rejection_sample, or through ops.greedy_accept (from the
    argmax, proposals read from a step's input ids: row 0 of each sequence is its last
    known token)."""
    if how == "greedy_accept":
        s, k = drafts.shape
        input_ids = torch.cat([torch.zeros(s, 1, dtype=torch.int64), drafts], dim=1).flatten()
        spec = torch.tensor([[i * (k + 1), k, i] for i in range(s)])
        verified, added, shift = ops.greedy_accept(probs.argmax(-1), input_ids, spec, num.to(torch.int32))
        token_ids, accepted = verified[:, : k + 1], verified[:, k + 1]
        assert shift.tolist() == (accepted - k).tolist() and verified[:, k + 2].tolist() == num.tolist()
        assert added.tolist() == token_ids.gather(1, accepted[:, None])[:, 0].tolist()
        return Verified(token_ids, accepted)
    return rejection_sample(probs, drafts, num, greedy=torch.ones(len(num), dtype=torch.bool))


@pytest.mark.parametrize("how", ["rejection_sample", "greedy_accept"])
def test_greedy_rows_keep_proposals_while_they_are_the_argmax(how):
    probs = _one_hot_probs([[3, 1, 4, 2], [3, 1, 4, 2], [3, 1, 4, 2], [5, 5, 5, 5]], vocab=8)
    drafts = torch.tensor([[3, 1, 4], [3, 0, 4], [6, 1, 4], [5, 5, 5]])
    num = torch.tensor([3, 3, 3, 1])  # the last row proposed one token only
    out = _verify_greedy(how, probs, drafts, num)
    assert out.num_accepted.tolist() == [3, 1, 0, 1]
    assert out.token_ids.tolist() == [[3, 1, 4, 2], [3, 1, -1, -1], [3, -1, -1, -1], [5, 5, -1, -1]]


@pytest.mark.parametrize("how", ["rejection_sample", "greedy_accept"])
def test_no_proposals_is_plain_decoding(how):
    probs = _one_hot_probs([[2], [6]], vocab=8)
    out = _verify_greedy(how, probs, torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    assert out.num_accepted.tolist() == [0, 0] and out.token_ids.tolist() == [[2], [6]]


def _frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / len(tokens)


@pytest.mark.parametrize("proposer", ["deterministic", "draft model"])
def test_sampled_tokens_keep_the_target_distribution(proposer):
    """Temperature 1 on a vocabulary of 5, k = 2, 200,000 sequences: the first output
    token follows p_0, and after a kept first proposal the second follows p_1,
    whichever proposals came (a fixed n-gram guess, or draws from a draft model's q)."""
    gen = torch.Generator().manual_seed(0)
    vocab, n, k = 5, 200_000, 2
    p = torch.tensor([[0.50, 0.20, 0.15, 0.10, 0.05],
                      [0.05, 0.05, 0.30, 0.40, 0.20],
                      [0.20, 0.20, 0.20, 0.20, 0.20]])
    probs = p.expand(n, k + 1, vocab)
    if proposer == "deterministic":
        drafts, q = torch.tensor([1, 3]).expand(n, k), None
    else:
        q_rows = torch.tensor([[0.10, 0.60, 0.10, 0.10, 0.10], [0.25, 0.25, 0.00, 0.25, 0.25]])
        drafts = torch.stack([torch.multinomial(q_rows[j], n, replacement=True, generator=gen)
                              for j in range(k)], dim=1)
        q = q_rows.expand(n, k, vocab)
    out = rejection_sample(probs, drafts, torch.full((n,), k), torch.zeros(n, dtype=torch.bool), q, gen)
    tolerance = 5 * (0.25 / n) ** 0.5  # five standard deviations of a frequency
    first = _frequencies(out.token_ids[:, 0], vocab)
    assert (first - p[0].double()).abs().max() < tolerance, first
    kept = out.num_accepted >= 1
    second = _frequencies(out.token_ids[kept, 1], vocab)
    assert (second - p[1].double()).abs().max() < 5 * (0.25 / int(kept.sum())) ** 0.5, second
    assert 0 < kept.float().mean() < 1  # both branches were taken


# -- in the engine ---------------------------------------------------------------------------

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def _prompts(n: int = 6) -> list[list[int]]:
    """Half with repeated phrases (the n-gram proposer finds them at once), half random."""
    repeated = [([7 + i, 40 + i, 90, 13 + 2 * i] * 4)[: 9 + i] for i in range(n // 2)]
    return repeated + random_prompts(n - n // 2, (5, 20), seed=11)


def _loras(adapter_dirs, arch, n):
    names = list(adapter_dirs[arch])
    return [None if i % 3 == 0 else
            LoRARequest(names[i % 3], 1 + i % 3, str(adapter_dirs[arch][names[i % 3]])) for i in range(n)]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_are_those_of_plain_decoding(arch, model_dirs, adapter_dirs):
    """Every dense architecture, base rows beside two adapters: greedy tokens with
    n-gram speculation equal plain decoding's, and proposals were kept."""
    prompts = _prompts()
    loras = _loras(adapter_dirs, arch, len(prompts))
    scored = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    plain = make_llm(model_dirs[arch]).generate(prompts, scored, loras, use_tqdm=False)
    llm = make_llm(model_dirs[arch], speculative_config=SPEC)
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), loras,
                       use_tqdm=False)
    for g, p in zip(got, plain):
        assert len(g.outputs[0].token_ids) == 24
        assert_same_greedy_tokens(g.outputs[0], p.outputs[0])
    stats = llm.engine.stats()
    assert 0 < stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"], stats


def test_speculation_under_preemption_stops_and_opt_outs(model_dirs):
    """A cache of 8 pages for 8 requests: preempted requests recompute and speculate
    again; stop tokens and max_tokens end a request inside a verified run exactly where
    plain decoding ends it; seeded random requests (which do not speculate) and rows
    with logprobs give plain decoding's tokens too."""
    prompts = _prompts(8)
    plain_llm = make_llm(model_dirs["qwen3"])
    llm = make_llm(model_dirs["qwen3"], speculative_config=SPEC, num_gpu_blocks_override=8, max_model_len=64,
                   max_num_seqs=8)
    first = plain_llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0].token_ids
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[first[5]]),
              SamplingParams(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)]
    sps = [params[i % len(params)] for i in range(len(prompts))]
    want = plain_llm.generate(prompts, sps, use_tqdm=False)
    got = llm.generate(prompts, sps, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in got) > 0
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids or DTYPE != "float32"
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
    assert llm.engine.stats()["spec_accepted_tokens"] > 0


def test_sampled_rows_speculate_and_keep_their_lengths(model_dirs, monkeypatch):
    """Temperature 0.8 with top-p, unseeded: rows speculate and every request gets its
    max_tokens (the distribution itself: test_sampled_tokens_keep_the_target_distribution)."""
    import loraplex.engine.scheduler as scheduler_module
    from loraplex.runner import ngram_drafts

    monkeypatch.setattr(scheduler_module, "SeenSuffix", AlwaysSeen)
    real = ngram_drafts.ops.ngram_inputs
    monkeypatch.setattr(ngram_drafts.ops, "ngram_inputs", repeat_last_on_device(real))
    llm = make_llm(model_dirs["qwen3"], speculative_config=SPEC)
    sp = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, ignore_eos=True)
    outs = llm.generate(_prompts(), sp, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
    assert llm.engine.stats()["spec_draft_tokens"] > 0


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """Tiny Qwen3-MoE: 8 experts, top-2."""
    return write_tiny_qwen3_moe(tmp_path_factory.mktemp("spec-moe") / "qwen3moe")


def test_a_draft_model_changes_no_token_and_its_own_proposals_are_kept(model_dirs, adapter_dirs):
    """draft_model, the model itself as its draft: base rows keep (nearly) every
    proposal; adapter rows (the draft runs bare) fewer; every token is plain decoding's,
    under preemption too (a cache of 8 pages for 8 requests: the draft starts over)."""
    arch = "qwen3"
    prompts = _prompts(8)
    loras = _loras(adapter_dirs, arch, len(prompts))
    plain = make_llm(model_dirs[arch], max_model_len=64).generate(
        prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5), loras,
        use_tqdm=False)
    spec = {"model": str(model_dirs[arch]), "num_speculative_tokens": 3}
    for pages in (None, 8):
        llm = make_llm(model_dirs[arch], speculative_config=spec, num_gpu_blocks_override=pages,
                       max_model_len=64, max_num_seqs=8)
        got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), loras,
                           use_tqdm=False)
        for g, p in zip(got, plain):
            assert_same_greedy_tokens(g.outputs[0], p.outputs[0])
        base = [g.metrics for g, lora in zip(got, loras) if lora is None]
        drafted, kept = sum(m.num_draft_tokens for m in base), sum(m.num_accepted_tokens for m in base)
        assert drafted > 0 and kept >= 0.9 * drafted, (drafted, kept)
        if pages:
            assert sum(g.metrics.num_preemptions for g in got) > 0


def test_a_draft_model_that_cannot_serve_is_refused_at_startup(model_dirs, tmp_path):
    """A draft directory without a model, or with another vocabulary: the engine does
    not start, and says why."""
    import transformers

    from loraplex.bench.synthetic import write_random_model
    from loraplex.errors import ModelLoadError

    other = write_random_model(tmp_path / "other-vocab", transformers.Qwen3Config(
        vocab_size=77, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=128), 1, None)
    for draft, error in ((tmp_path / "missing", "not a model directory"), (other, "vocabulary")):
        with pytest.raises(ModelLoadError, match=error):
            make_llm(model_dirs["qwen3"], speculative_config={"model": str(draft),
                                                              "num_speculative_tokens": 2})


def test_the_caches_are_sized_together(model_dirs):
    """The target's runner counts the draft's page beside each of its own: the bytes it
    sets aside per page are what the draft's cache takes per page."""
    llm = make_llm(model_dirs["qwen3"], speculative_config={"model": str(model_dirs["llama"]),
                                                            "num_speculative_tokens": 2})
    draft = llm.engine.draft_model.runner
    layers = draft._attention_layers()
    per_page = sum(t[0].nbytes for layer in layers for t in (layer.k_cache, layer.v_cache))
    assert llm.engine.runner.shared_page_bytes == per_page > 0
    assert draft.num_blocks == llm.engine.runner.num_blocks


def _kept_share(outs, loras, adapted: bool) -> float:
    metrics = [o.metrics for o, lora in zip(outs, loras) if (lora is not None) == adapted]
    drafted = sum(m.num_draft_tokens for m in metrics)
    assert drafted > 0
    return sum(m.num_accepted_tokens for m in metrics) / drafted


def test_draft_adapters_follow_the_request_adapter(model_dirs, adapter_dirs, tmp_path):
    """The draft (here the model itself) takes each adapter's draft adapter: from the
    config's draft_adapters, or the adapter directory's draft/ subdirectory. Adapter
    rows then keep (nearly) every proposal, against fewer with the bare draft; a draft
    adapter that cannot be read leaves its rows to the bare draft. Tokens are plain
    decoding's throughout."""
    import shutil

    arch = "qwen3"
    prompts = _prompts(8)
    names = list(adapter_dirs[arch])
    # requests of adapter 1 map through the config; adapter 2's directory carries draft/
    mapped, carried = names[1], tmp_path / "carried"
    shutil.copytree(adapter_dirs[arch][names[2]], carried)
    shutil.copytree(adapter_dirs[arch][names[2]], carried / "draft")
    loras = [None if i % 3 == 0 else LoRARequest(mapped, 1, str(adapter_dirs[arch][mapped])) if i % 3 == 1
             else LoRARequest(names[2], 2, str(carried)) for i in range(len(prompts))]
    scored = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
    plain = make_llm(model_dirs[arch]).generate(prompts, scored, loras, use_tqdm=False)
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    bare = make_llm(model_dirs[arch], speculative_config={"model": str(model_dirs[arch]),
                                                          "num_speculative_tokens": 3})
    bare_outs = bare.generate(prompts, sp, [lo if lo is None or lo.lora_name == mapped else
                                            LoRARequest(names[2], 2, str(adapter_dirs[arch][names[2]]))
                                            for lo in loras], use_tqdm=False)
    spec = {"model": str(model_dirs[arch]), "num_speculative_tokens": 3,
            "draft_adapters": {mapped: str(adapter_dirs[arch][mapped])}}
    outs = make_llm(model_dirs[arch], speculative_config=spec).generate(prompts, sp, loras, use_tqdm=False)
    for got in (bare_outs, outs):
        for g, p in zip(got, plain):
            assert_same_greedy_tokens(g.outputs[0], p.outputs[0])
    assert _kept_share(outs, loras, True) >= 0.8 > _kept_share(bare_outs, loras, True)

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{not json")
    spec["draft_adapters"] = {mapped: str(broken)}
    outs = make_llm(model_dirs[arch], speculative_config=spec).generate(prompts, sp, loras, use_tqdm=False)
    for g, p in zip(outs, plain):
        assert_same_greedy_tokens(g.outputs[0], p.outputs[0])


def test_moe_greedy_tokens_are_those_of_plain_decoding(moe_dir):
    """Qwen3-MoE (experts in the verified positions too): speculation changes no token."""
    prompts = _prompts()
    plain = make_llm(moe_dir).generate(
        prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5), use_tqdm=False)
    llm = make_llm(moe_dir, speculative_config=SPEC)
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for g, p in zip(got, plain):
        assert_same_greedy_tokens(g.outputs[0], p.outputs[0])
    assert llm.engine.stats()["spec_accepted_tokens"] > 0


def test_server_speculates_and_reports_it(chat_model):
    """`loraplex serve --speculative-config`: completions (streamed or not, speculating or
    opted out) equal the offline engine's plain greedy text; the receipt counts the
    proposed and kept tokens, /metrics the totals."""
    import httpx
    from serving import client, running, serve_args

    prompt = "t5 t6 t7 t8 t5 t6 t7 t8 t5 t6"
    want = make_llm(chat_model, max_model_len=96).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    servers = running(serve_args(chat_model, "--speculative-config", json.dumps(SPEC)))
    server = next(servers)
    try:
        r = client(server).completions.create(model=str(chat_model), prompt=prompt, max_tokens=20,
                                              temperature=0, extra_body={"ignore_eos": True})
        assert r.choices[0].text == want.text and r.usage.completion_tokens == 20
        receipt = r.model_extra["loraplex"]
        assert 0 < receipt["speculated_tokens_accepted"] <= receipt["speculated_tokens"], receipt
        chunks = list(client(server).completions.create(
            model=str(chat_model), prompt=prompt, max_tokens=20, temperature=0, stream=True,
            extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
        plain = client(server).completions.create(model=str(chat_model), prompt=prompt, max_tokens=20,
                                                  temperature=0, extra_body={"ignore_eos": True,
                                                                             "speculate": False})
        assert plain.choices[0].text == want.text
        assert plain.model_extra["loraplex"]["speculated_tokens"] == 0
        bad = httpx.post(server.url + "/v1/completions", json={
            "model": str(chat_model), "prompt": prompt, "max_tokens": 4, "speculate": "maybe"})
        assert bad.status_code == 400 and "speculate" in bad.json()["error"]["message"], bad.text
        text = httpx.get(server.url + "/metrics").text
        assert "loraplex_spec_decode_draft_tokens_total" in text
        assert "loraplex_spec_decode_accepted_tokens_total" in text
        assert "loraplex_spec_decode_num_drafts_total" in text
    finally:
        next(servers, None)


def test_large_batches_do_not_speculate(model_dirs):
    """disable_by_batch_size 2: four requests in flight together propose nothing; one
    alone does."""
    spec = {**SPEC, "disable_by_batch_size": 2}
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = make_llm(model_dirs["qwen3"], speculative_config=spec)
    llm.generate(_prompts(4), sp, use_tqdm=False)
    assert llm.engine.stats()["spec_draft_tokens"] == 0
    llm.generate(_prompts(4)[:1], sp, use_tqdm=False)
    assert llm.engine.stats()["spec_draft_tokens"] > 0


@pytest.mark.parametrize("temperature,top_k,top_p",
                         [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.6, 4, 0.9)])
def test_verification_probabilities_are_the_samplers(temperature, top_k, top_p):
    """sampling_probs (what verification accepts against) is the distribution sample()
    draws from: 40,000 draws of one row of peaked logits, frequencies within five
    standard deviations."""
    from loraplex.runner.sampler import SamplingRows, sample, sampling_probs

    n, vocab = 40_000, 8
    logits = (torch.randn(1, vocab, generator=torch.Generator().manual_seed(1)) * 2).expand(n, vocab)
    rows = SamplingRows(temperature=[temperature] * n, top_k=[top_k] * n, top_p=[top_p] * n,
                        generators=[None] * n, banned=[[]] * n)
    drawn = sample(logits.clone(), rows, torch.Generator().manual_seed(2))
    want = sampling_probs(logits[:1].clone(), [temperature], [top_k], [top_p])[0].double()
    got = _frequencies(drawn, vocab)
    assert (got - want).abs().max() < 5 * (0.25 / n) ** 0.5, (got, want)
    assert ((want > 0) == (got > 0)).all()  # the same tokens cut by top-k / top-p


def test_the_engine_keeps_the_sampled_distribution(tmp_path):
    """Through the whole engine, at temperature 1 on a vocabulary of 12: 3,000 samples of
    five tokens after a repetitive prompt, with n-gram speculation and with a draft model
    (another random model: proposals verified and often rejected), and without. Each
    position's token frequencies agree within five standard deviations of their
    difference."""
    import transformers

    from loraplex.bench.synthetic import write_random_model

    cfg = transformers.Qwen3Config(
        vocab_size=12, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
        initializer_range=0.6, tie_word_embeddings=False)
    model = write_random_model(tmp_path / "tiny-vocab", cfg, 3, None)
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    n, out_len = 3000, 5
    sp = SamplingParams(temperature=1.0, max_tokens=out_len, ignore_eos=True)
    samples = {}
    draft = write_random_model(tmp_path / "tiny-vocab-draft", cfg, 4, None)  # another model: often wrong
    for label, spec in (("plain", None), ("ngram", SPEC), ("draft", {"model": str(draft),
                                                                       "num_speculative_tokens": 3})):
        llm = make_llm(model, speculative_config=spec, max_num_seqs=256, max_model_len=32, seed=7,
                       max_loras=0)
        outs = llm.generate([prompt] * n, sp, use_tqdm=False)
        samples[label] = torch.tensor([o.outputs[0].token_ids for o in outs])
        if spec is not None:
            stats = llm.engine.stats()
            assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], stats
    tolerance = 5 * (2 * 0.25 / n) ** 0.5
    for pos in range(out_len):
        plain = _frequencies(samples["plain"][:, pos], 12)
        for label in ("ngram", "draft"):
            spec = _frequencies(samples[label][:, pos], 12)
            assert (plain - spec).abs().max() < tolerance, (label, pos, plain, spec)


# -- adaptivity ------------------------------------------------------------------------------


class _AlwaysMatches:
    """SeenSuffix that always finds a match: the request proposes whatever it earned."""

    def matches(self, prompt, output):
        return True


def _spec_scheduler(k=4, requests=1):
    from loraplex.adapters.slot_table import SlotTable
    from loraplex.config import SchedulerConfig
    from loraplex.engine.block_manager import BlockManager
    from loraplex.engine.request import Request
    from loraplex.engine.scheduler import Scheduler

    cfg = SchedulerConfig(max_num_seqs=requests, max_num_batched_tokens=256, max_model_len=1024)
    sched = Scheduler(cfg, BlockManager(512, 4), SlotTable(1),
                      SpeculativeConfig.parse({"num_speculative_tokens": k}))
    reqs = []
    for i in range(requests):
        req = Request(request_id=f"r{i}", prompt_token_ids=[3, 4, 5, 6],
                      sampling=SamplingParams(temperature=0, max_tokens=900, ignore_eos=True))
        req.seen_suffix = _AlwaysMatches()
        sched.add(req)
        reqs.append(req)
    return sched, reqs


def _step(sched, keep: bool) -> list[int]:
    """One plan and its result, the device having filled every draft position (tokens
    of 1), all kept (keep) or none; the drafts proposed."""
    from loraplex.types import StepResult

    plan = sched.schedule()
    n = len(plan.chunks)
    result = StepResult([None if c.draft_ids else 2 for c in plan.chunks], [None] * n, [None] * n)
    for i, c in enumerate(plan.chunks):
        if c.draft_ids:
            result.speculated[i] = ([1] * len(c.draft_ids) if keep else []) + [2]
            result.num_proposed[i] = len(c.draft_ids)
    sched.update(plan, result)
    return [len(c.draft_ids or ()) for c in plan.chunks]


def test_proposals_never_kept_stop_and_probes_bring_them_back():
    """A request whose proposals are never kept proposes k, then k / 2, then nothing but
    one-token probes, on plans that are multiples of a period doubling from
    PROBE_PERIOD with each probe not kept (powers of two: the probes of all requests
    fall on the same plans); a kept probe restores proposals and the period."""
    sched, (req,) = _spec_scheduler()
    _step(sched, keep=True)  # the prompt
    proposed = {}
    while sched.num_plans < 128:
        index = sched.num_plans
        proposed[index] = _step(sched, keep=False)[0]
    assert [proposed[1], proposed[2]] == [4, 2]  # acceptance 0.5, then 0.35
    assert {i: d for i, d in proposed.items() if i > 2 and d} == {8: 1, 16: 1, 32: 1, 64: 1}
    assert not sched.wants_proposals()  # proposals made on the device: planning stays overlapped
    assert sched.num_plans == 128 and _step(sched, keep=True) == [1]  # the probe is kept
    assert _step(sched, keep=True)[0] >= 2 and req.acceptance.probe_period == PROBE_PERIOD


class _MatchEveryOther:
    """SeenSuffix with a match every other step only."""

    def __init__(self):
        self.calls = 0

    def matches(self, prompt, output):
        self.calls += 1
        return self.calls % 2 == 1


def test_steps_without_a_match_leave_the_acceptance_be():
    """A request whose proposals are all kept but that has a match only every other step
    (quoting with gaps) proposes k whenever it has one: steps without a match propose
    nothing and cost nothing, so they do not count against it."""
    sched, (req,) = _spec_scheduler()
    req.seen_suffix = _MatchEveryOther()
    _step(sched, keep=True)  # the prompt
    proposed = [_step(sched, keep=True)[0] for _ in range(12)]
    assert proposed == [4, 0] * 6 and req.acceptance.rate > 0.9


def test_a_step_proposes_at_most_its_draft_room():
    """Forty decoding requests at k = 4 propose DRAFT_TOKENS_PER_STEP tokens a step,
    not 160."""
    from loraplex.config import DRAFT_TOKENS_PER_STEP

    sched, reqs = _spec_scheduler(k=4, requests=40)
    _step(sched, keep=True)
    assert sum(_step(sched, keep=True)) == DRAFT_TOKENS_PER_STEP


def test_requests_that_opt_out_decode_plainly_and_the_engine_overlaps_them(model_dirs):
    """speculate=False: the request proposes nothing, its tokens are plain decoding's,
    and with no request proposing the engine plans each step while the one before runs."""
    prompts = _prompts(4)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, speculate=False)
    want = make_llm(model_dirs["qwen3"]).generate(prompts, SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, logprobs=5), use_tqdm=False)
    llm = make_llm(model_dirs["qwen3"], speculative_config=SPEC)
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"q{i}", p, sp)
    got, overlapped = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out
        overlapped += engine._in_flight is not None
    assert engine.stats()["spec_draft_tokens"] == 0 and overlapped >= 10
    for i, w in enumerate(want):
        assert_same_greedy_tokens(got[f"q{i}"].outputs[0], w.outputs[0])


def _run_counting_overlap(engine, requests) -> tuple[dict, int]:
    """Step the engine over `requests` [(id, prompt, params, lora)]; returns the final
    outputs and how many steps left a step with device proposals in flight."""
    for request_id, prompt, sp, lora in requests:
        engine.add_request(request_id, prompt, sp, lora_request=lora)
    got, overlapped = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out
        flying = engine._in_flight
        overlapped += flying is not None and any(c.device_drafts for c in flying.plan.chunks)
    return got, overlapped


def test_device_proposals_are_planned_ahead_of_results(model_dirs, adapter_dirs):
    """n-gram proposals made on the device: a step that speculates is planned while the
    one before it runs (whose verification decides where it starts), base and adapter
    rows together, and greedy tokens stay plain decoding's; with prefix caching, a
    request admitted onto cached pages proposes from tokens it never fed (its history
    is written from the host at admission)."""
    prompts = [(p * 4)[:40] for p in _prompts(6)]  # two full pages of 16 tokens each
    loras = _loras(adapter_dirs, "llama", len(prompts))
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    scored = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=5)  # bf16: near-ties
    want = make_llm(model_dirs["llama"]).generate(prompts, scored, loras, use_tqdm=False)
    llm = make_llm(model_dirs["llama"], speculative_config=SPEC, enable_prefix_caching=True)
    assert llm.engine.runner.ngram is not None and llm.engine.scheduler.ngram_on_device
    got, overlapped = _run_counting_overlap(
        llm.engine, [(f"r{i}", p, sp, lora) for i, (p, lora) in enumerate(zip(prompts, loras))])
    for i, w in enumerate(want):
        assert_same_greedy_tokens(got[f"r{i}"].outputs[0], w.outputs[0])
    stats = llm.engine.stats()
    assert overlapped >= 5, overlapped
    assert 0 < stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"], stats

    # The same prompts again: their full pages are cached, so their first chunks start
    # past tokens the runner never saw this time.
    again, _ = _run_counting_overlap(
        llm.engine, [(f"s{i}", p, sp, lora) for i, (p, lora) in enumerate(zip(prompts, loras))])
    assert sum(o.num_cached_tokens for o in again.values()) > 0
    for i, w in enumerate(want):
        assert_same_greedy_tokens(again[f"s{i}"].outputs[0], w.outputs[0])
    assert llm.engine.stats()["spec_accepted_tokens"] > stats["spec_accepted_tokens"]
