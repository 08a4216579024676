"""One request's input never ends another's: values that no step can run are refused
before queueing, and a step that fails anyway ends only the request that caused it
(the others are recomputed and finish as if nothing happened)."""

from __future__ import annotations

import pytest
from conftest import VOCAB, make_llm

from loraplex import SamplingParams
from loraplex.errors import EngineFailure, InvalidRequest, RequestFailed

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(model_dirs):
    return make_llm(model_dirs["qwen3"], max_num_seqs=8)


def _run(engine, requests: dict[str, tuple[list[int], SamplingParams]], on_step=None):
    """Queue every request, step to the end; request id -> final output."""
    for request_id, (ids, sp) in requests.items():
        engine.add_request(request_id, ids, sp)
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        if on_step:
            on_step(steps)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
    return done


@pytest.mark.parametrize("bad", [
    dict(temperature=1.0, seed=2**64),
    dict(temperature=1.0, seed=-(2**63) - 1),
    dict(temperature=1.0, seed=10**30),
    dict(temperature=float("inf")),
    dict(temperature=0.5, min_tokens=3, stop_token_ids=[100000]),
    dict(temperature=0.5, min_tokens=3, stop_token_ids=[-1]),
], ids=["seed-2^64", "seed-below-int64", "seed-1e30", "temperature-inf", "stop-id-past-vocab",
        "stop-id-negative"])
def test_values_no_step_can_run_are_refused_before_queueing(llm, bad):
    engine = llm.engine
    with pytest.raises(InvalidRequest):
        engine.add_request("bad", [5, 6, 7], SamplingParams(max_tokens=4, **bad))
    assert not engine.has_unfinished_requests()


def test_seeds_at_the_64_bit_limits_run(llm):
    for seed in (2**64 - 1, -(2**63)):
        sp = SamplingParams(temperature=1.0, top_k=5, max_tokens=3, seed=seed)
        assert len(llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].outputs[0].token_ids) == 3


def test_a_step_that_fails_on_one_request_ends_only_that_request(llm, monkeypatch):
    """A request whose sampling state raises inside the step (as an out-of-range seed
    did before admission checked it) ends with its error; its batch mates are
    recomputed and give exactly the tokens of a run without it."""
    prompts = {f"r{i}": ([5 + i, 9, 11, 13 + i], GREEDY) for i in range(4)}
    want = _run(llm.engine, prompts)
    runner = llm.engine.runner
    original = runner._banned_tokens

    def poisoned(chunk):
        if chunk.request_id == "victim" and chunk.num_output_tokens == 2:
            raise RuntimeError("a value no kernel takes")
        return original(chunk)

    monkeypatch.setattr(runner, "_banned_tokens", poisoned)
    requests = {**prompts, "victim": ([7, 8, 9], SamplingParams(temperature=0, max_tokens=8))}
    got = _run(llm.engine, requests)
    assert got["victim"].outputs[0].finish_reason == "error"
    assert isinstance(got["victim"].error, RequestFailed) and "victim" in str(got["victim"].error)
    for request_id, out in want.items():
        assert got[request_id].outputs[0].finish_reason == "length"
        assert got[request_id].outputs[0].token_ids == out.outputs[0].token_ids, request_id


def test_a_request_that_no_longer_passes_admission_is_the_culprit(llm, monkeypatch):
    """A step fails with no request named while a live request's parameters no longer
    pass the admission checks (changed after queueing): that request is ended alone."""
    import loraplex.runner.model_runner as model_runner

    engine = llm.engine
    prompts = {f"r{i}": ([5 + i, 9, 11], GREEDY) for i in range(3)}
    want = _run(engine, prompts)
    bad = SamplingParams(temperature=0.5, max_tokens=8)
    sample, calls = model_runner.sample, {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            bad.seed = 2**70  # changed after admission checked it
            raise RuntimeError("a batched op failed")
        return sample(*args, **kwargs)

    monkeypatch.setattr(model_runner, "sample", failing)
    got = _run(engine, {**prompts, "bad": ([7, 8], bad)})
    assert got["bad"].outputs[0].finish_reason == "error"
    assert isinstance(got["bad"].error, InvalidRequest)
    for request_id, out in want.items():
        assert got[request_id].outputs[0].token_ids == out.outputs[0].token_ids, request_id


def test_an_out_of_vocabulary_ban_never_reaches_the_device(llm):
    """Defence in depth: a banned id outside the vocabulary (it could only get past
    admission by a change made later) fails its row's own state on the host, naming its
    request, instead of indexing the logits out of range (a device assert on a GPU,
    which no step recovers from)."""
    engine = llm.engine
    bad = SamplingParams(temperature=0.5, max_tokens=8, min_tokens=4)
    engine.add_request("oov", [5, 6], bad)
    bad.stop_token_ids.append(VOCAB + 5)
    got = _run(engine, {"ok": ([7, 8, 9], GREEDY)})
    assert got["oov"].outputs[0].finish_reason == "error"
    assert isinstance(got["oov"].error, RequestFailed)
    assert got["ok"].outputs[0].finish_reason == "length"


def test_a_failure_no_request_explains_ends_the_batch_only(llm, monkeypatch):
    """With no culprit to tell apart, the requests of the failed batch end with an
    explicit error; requests still waiting were not in it and finish normally."""
    engine = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = _run(engine, {"late": ([5, 6, 7], sp)})["late"]
    model, calls = engine.runner.model, {"n": 0}
    forward = type(model).forward

    def flaky(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device fault")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", flaky)
    monkeypatch.setattr(engine.runner, "graphs", None)  # eager steps call forward
    batch = {f"b{i}": ([9, 10 + i], sp) for i in range(8)}  # fills max_num_seqs
    got = _run(engine, {**batch, "late": ([5, 6, 7], sp)})
    failed = [r for r, out in got.items() if out.outputs[0].finish_reason == "error"]
    assert failed and set(failed) <= set(batch)
    assert all(isinstance(got[r].error, EngineFailure) for r in failed)
    assert got["late"].outputs[0].token_ids == want.outputs[0].token_ids
