"""The HTTP server end to end: a real uvicorn server on loopback, driven by the official
`openai` client (and raw httpx where the client would refuse to send bad input)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from conftest import make_llm
from serving import ACME, ADMIN, GLOBEX, client, free_port, idle, running, serve_args, tenant_serve_args

from loraplex import LoRARequest, SamplingParams


@pytest.fixture(scope="module")
def server(chat_model, adapter_dirs, tmp_path_factory):
    yield from running(tenant_serve_args(chat_model, adapter_dirs, tmp_path_factory.mktemp("keys")))


@pytest.fixture(scope="module")
def offline(chat_model):
    """The same model offline: the oracle for what the server returns."""
    return make_llm(chat_model, max_model_len=96)


def test_completion_matches_offline_engine(server, offline):
    sp = SamplingParams(temperature=0, max_tokens=6)
    want = offline.generate(["t5 t6 t7"], sp)[0].outputs[0]
    r = client(server).completions.create(model="tiny", prompt="t5 t6 t7", max_tokens=6, temperature=0)
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 6
    receipt = r.model_extra["loraplex"]
    assert receipt["adapter"] is None and receipt["completion_tokens"] == 6
    assert receipt["ttft_ms"] > 0 and receipt["e2e_ms"] >= receipt["ttft_ms"]

    stream = client(server).completions.create(
        model="tiny", prompt="t5 t6 t7", max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == 6 and "loraplex" in chunks[-1].model_extra
    ids = client(server).completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=6, temperature=0)
    assert ids.choices[0].text == want.text


def test_chat_streaming_and_not(server, offline):
    msgs = [{"role": "user", "content": "t9 t10"}, {"role": "user", "content": "t11"}]
    want = offline.generate(["t9 t10 t11 "], SamplingParams(temperature=0, max_tokens=5))[0]
    r = client(server).chat.completions.create(model="tiny", messages=msgs, max_tokens=5, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want.outputs[0].text
    assert r.model_extra["loraplex"]["prompt_tokens"] == 3
    chunks = list(client(server).chat.completions.create(
        model="tiny", messages=msgs, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.outputs[0].text
    assert chunks[-1].usage.completion_tokens == 5


def test_adapters_are_applied_and_listed(server, offline, adapter_dirs):
    lora = LoRARequest("x", 1, str(adapter_dirs["qwen3"]["all7-r8"]))
    want = offline.generate(["t5 t6 t7"], SamplingParams(temperature=0, max_tokens=6), lora)[0]
    r = client(server).completions.create(model="public-ad", prompt="t5 t6 t7", max_tokens=6,
                                          temperature=0)
    assert r.choices[0].text == want.outputs[0].text
    assert r.model_extra["loraplex"]["adapter"] == "public-ad"
    assert r.model_extra["loraplex"]["adapter_source"] in ("device", "host", "disk")
    models = {m.id: m for m in client(server, ACME).models.list()}
    assert set(models) == {"tiny", "public-ad", "acme-ad"}
    assert models["acme-ad"].model_extra["parent"] == "tiny"


def test_tenants_and_keys(server):
    acme, globex = client(server, ACME), client(server, GLOBEX)
    assert acme.completions.create(model="acme-ad", prompt="t5", max_tokens=2).choices
    assert {m.id for m in globex.models.list()} == {"tiny", "public-ad"}
    with pytest.raises(openai.NotFoundError) as hidden:
        globex.completions.create(model="acme-ad", prompt="t5", max_tokens=2)
    with pytest.raises(openai.NotFoundError) as missing:
        globex.completions.create(model="no-such-ad", prompt="t5", max_tokens=2)
    # No hint that acme-ad exists: the same answer as for a name nobody uses.
    assert hidden.value.message.replace("acme-ad", "X") == missing.value.message.replace("no-such-ad", "X")
    for key in (None, "sk-wrong"):
        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "t5"},
                       headers={"Authorization": f"Bearer {key}"} if key else {})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"},
                   headers={"Authorization": f"Bearer {ACME}"})
    assert r.status_code == 403


def test_load_and_unload_adapters(server, adapter_dirs):
    admin = {"Authorization": f"Bearer {ADMIN}"}
    path = str(adapter_dirs["qwen3"]["mlp-o-r16-patterns"])
    r = httpx.post(server.url + "/v1/load_lora_adapter",
                   json={"lora_name": "new-ad", "lora_path": path}, headers=admin)
    assert r.status_code == 200, r.text
    assert "new-ad" in {m.id for m in client(server, GLOBEX).models.list()}
    out = client(server, GLOBEX).completions.create(model="new-ad", prompt="t5 t6", max_tokens=3)
    assert out.model_extra["loraplex"]["adapter"] == "new-ad"
    again = httpx.post(server.url + "/v1/load_lora_adapter",
                       json={"lora_name": "new-ad", "lora_path": path}, headers=admin)
    assert again.status_code == 400
    bad = httpx.post(server.url + "/v1/load_lora_adapter",
                     json={"lora_name": "broken", "lora_path": "/no/such/dir"}, headers=admin)
    assert bad.status_code == 400 and "broken" in bad.json()["error"]["message"]
    assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "new-ad"},
                      headers=admin).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client(server).completions.create(model="new-ad", prompt="t5", max_tokens=2)
    assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "new-ad"},
                      headers=admin).status_code == 404


@pytest.fixture(scope="module")
def registry_server(chat_model, adapter_dirs, tmp_path_factory):
    """A server with an adapter registry and a pinned adapter."""

    from loraplex.adapters.registry import Registry

    root = tmp_path_factory.mktemp("registry")
    registry = Registry(str(root))
    ads = adapter_dirs["qwen3"]
    registry.publish("support", ads["qv-r4-rslora"], owner=None)
    registry.publish("support", ads["all7-r8"], owner=None)
    _, broken = registry.publish("broken", ads["mlp-o-r16-patterns"], owner=None)
    blob = root / "blobs" / broken.replace(":", "-") / "adapter_model.safetensors"
    blob.write_bytes(blob.read_bytes()[:100])  # truncated after publishing
    yield from running(serve_args(
        chat_model, "--served-model-name", "tiny", "--lora-registry", str(root),
        "--lora-modules", f"pinned-ad={ads['all7-r8']}", "--pinned-loras", "pinned-ad",
        "--lora-cache-dir", str(tmp_path_factory.mktemp("lora-cache")), "--lora-load-timeout", "3"))


def test_registry_adapters_pinning_and_load_failures(registry_server, offline, adapter_dirs):
    ads = adapter_dirs["qwen3"]
    c = client(registry_server)
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    for model, adapter in [("support", "all7-r8"), ("support@1", "qv-r4-rslora"), ("pinned-ad", "all7-r8")]:
        want = offline.generate(["t5 t6 t7"], sp, LoRARequest(adapter, 1, str(ads[adapter])))[0]
        r = c.completions.create(model=model, prompt="t5 t6 t7", max_tokens=5, temperature=0,
                                 extra_body={"ignore_eos": True})
        assert r.choices[0].text == want.outputs[0].text, model
        assert r.model_extra["loraplex"]["adapter_content_id"] == want.metrics.adapter_content_id
    assert r.model_extra["loraplex"]["adapter_source"] == "device", "pinned: always in a slot"
    assert {"support", "broken", "pinned-ad"} <= {m.id for m in c.models.list()}
    slots = registry_server.engine.engine.scheduler.slots
    pinned = slots.slot_of(r.model_extra["loraplex"]["adapter_content_id"])
    assert pinned is not None and slots.refs(pinned) == 1, "the pin holds its slot between requests"

    # The registry knows "broken" but its file is truncated: the load fails on a loader
    # thread, and the request (streaming or not) gets a 400 before any chunk.
    with pytest.raises(openai.BadRequestError, match="broken"):
        c.completions.create(model="broken", prompt="t5", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="broken"):
        list(c.chat.completions.create(model="broken", messages=[{"role": "user", "content": "t5"}],
                                       max_tokens=2, stream=True))
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="support@7", prompt="t5", max_tokens=2)
    unreachable = httpx.post(registry_server.url + "/v1/load_lora_adapter",
                             json={"lora_name": "far", "lora_path": "http://127.0.0.1:1/far"})
    assert unreachable.status_code == 503 and "far" in unreachable.json()["error"]["message"]
    assert c.completions.create(model="tiny", prompt="t5", max_tokens=2).choices[0].finish_reason


BAD_BODIES = [
    ("not json", b"{model: tiny"),
    ("wrong type", {"model": "tiny", "prompt": "t5", "max_tokens": "many"}),
    ("missing prompt", {"model": "tiny"}),
    ("prompt too long", {"model": "tiny", "prompt": " ".join(["t5"] * 100)}),
    ("max_tokens 0", {"model": "tiny", "prompt": "t5", "max_tokens": 0}),
    ("max_tokens past context", {"model": "tiny", "prompt": "t5 t6", "max_tokens": 95}),
    ("negative temperature", {"model": "tiny", "prompt": "t5", "temperature": -0.5}),
    ("top_p 0", {"model": "tiny", "prompt": "t5", "top_p": 0}),
    ("top_p above 1", {"model": "tiny", "prompt": "t5", "top_p": 1.5}),
    ("too many stops", {"model": "tiny", "prompt": "t5", "stop": [f"s{i}" for i in range(17)]}),
    ("n above limit", {"model": "tiny", "prompt": "t5", "n": 65}),
    ("best_of under n", {"model": "tiny", "prompt": "t5", "n": 3, "best_of": 2}),
    ("best_of streamed", {"model": "tiny", "prompt": "t5", "n": 1, "best_of": 2, "stream": True}),
    ("token id out of vocab", {"model": "tiny", "prompt": [5, 100000]}),
    ("empty messages", "chat", {"model": "tiny", "messages": []}),
    ("bad role", "chat", {"model": "tiny", "messages": [{"role": "robot", "content": "t5"}]}),
]


@pytest.mark.parametrize("case", BAD_BODIES, ids=[c[0] for c in BAD_BODIES])
def test_bad_input_gets_a_clear_error(server, case):
    endpoint = "/v1/chat/completions" if len(case) == 3 else "/v1/completions"
    body = case[-1]
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + endpoint, headers={"Authorization": f"Bearer {ADMIN}",
                                                   "Content-Type": "application/json"}, **kwargs)
    assert r.status_code in (400, 422), r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    # ... and the server still answers.
    assert client(server).completions.create(model="tiny", prompt="t5", max_tokens=2).choices


def test_client_disconnect_frees_the_sequence(server):
    headers = {"Authorization": f"Bearer {ADMIN}"}
    body = {"model": "tiny", "prompt": "t5 t6", "max_tokens": 90, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 2:
                break  # leave mid-stream
    assert idle(server), "a disconnected stream must free its sequence"
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client giving up
        httpx.post(server.url + "/v1/completions", headers=headers, timeout=0.05,
                   json={**body, "stream": False, "max_tokens": 90})
    assert idle(server)
    blocks = server.engine.engine.scheduler.blocks
    assert blocks.num_free_blocks == blocks.num_blocks


def test_hundreds_of_concurrent_streams(server):
    """Every stream ends with its complete answer or an explicit error."""

    async def one(c, i):
        stream = await c.completions.create(
            model=["tiny", "public-ad", "acme-ad"][i % 3], prompt=f"t{5 + i % 50} t7",
            max_tokens=8, stream=True, extra_body={"ignore_eos": True},
            stream_options={"include_usage": True})
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage:
                usage = chunk.usage
        return text, usage.completion_tokens

    async def main():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=ADMIN, max_retries=0,
                               http_client=openai.DefaultAsyncHttpxClient(
                                   limits=httpx.Limits(max_connections=400)))
        return await asyncio.gather(*(one(c, i) for i in range(300)), return_exceptions=True)

    results = asyncio.run(main())
    errors = [r for r in results if isinstance(r, Exception)]
    assert all(isinstance(e, openai.APIError) for e in errors), errors[:3]
    answers = [r for r in results if not isinstance(r, Exception)]
    # 8 tokens each (BOS/EOS ids among them decode to no text).
    assert all(n == 8 and 0 < len(text.split()) <= 8 for text, n in answers)
    assert len(errors) == 0
    assert idle(server)


def test_metrics_are_prometheus(server):
    client(server).completions.create(model="public-ad", prompt="t5", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client(server).completions.create(model="tiny", prompt="t5", max_tokens=-1)
    assert httpx.get(server.url + "/metrics").status_code == 401, "keys configured: metrics need one"
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {GLOBEX}"}).text
    for name in ("loraplex_requests_total", "loraplex_time_to_first_token_seconds_bucket",
                 "loraplex_time_per_output_token_seconds_bucket",
                 "loraplex_e2e_request_latency_seconds_count", "loraplex_num_requests_waiting",
                 'loraplex_adapter_requests_total{tier=', 'loraplex_adapter_loads_total{tier="device"}',
                 'loraplex_adapter_evictions_total{tier="host"}', "loraplex_adapter_load_seconds_count"):
        assert name in text, name
    assert 'loraplex_requests_total{endpoint="completions",outcome="rejected"}' in text
    assert httpx.get(server.url + "/health").status_code == 200


def test_bench_over_http_reports_the_in_process_metrics(server, chat_model, tmp_path):
    from loraplex.bench.report import BenchResult
    from loraplex.entrypoints.cli import main as cli

    common = ["bench", "--model", str(chat_model), "--num-prompts", "6", "--input-len", "8",
              "--output-len", "4", "--max-concurrency", "3", "--cache-dir", str(tmp_path)]
    http_json, local_json = tmp_path / "http.json", tmp_path / "local.json"
    assert cli([*common, "--base-url", server.url, "--served-model-name", "tiny",
                "--api-key", ADMIN, "--result-json", str(http_json)]) == 0
    assert cli([*common, "--dtype", "float32", "--result-json", str(local_json)]) == 0
    http, local = json.loads(http_json.read_text())[0], json.loads(local_json.read_text())[0]
    assert set(http) == set(local) == set(BenchResult.__dataclass_fields__) - {"ttfts", "tpots"}
    assert http["num_failed"] == local["num_failed"] == 0
    assert http["tpot_ms"]["median"] > 0 and local["tpot_ms"]["median"] > 0


@pytest.mark.parametrize("signals, drain", [((0.5,), 1), ((0.5, 1.5), 30), ((0.5, 1.5, 1.6, 1.7), 30)],
                         ids=["once", "twice", "four-times"])
def test_shutdown_ends_every_request(chat_model, signals, drain):
    """SIGTERM: every stream ends with its answer or an explicit error event, and the
    process exits; a second signal ends the drain at once, and however many come, no
    response is cut without its error event and [DONE] (the error path itself:
    test_drain_ends_unfinished_requests)."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    args = serve_args(chat_model, "--port", str(port), "--shutdown-timeout", str(drain),
                      "--served-model-name", "tiny")
    args[args.index("--max-model-len") + 1] = "512"  # room for a request longer than the drain
    proc = subprocess.Popen(
        [sys.executable, "-m", "loraplex.entrypoints.cli", "serve", *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        results = {}

        def stream(name, max_tokens, delay):
            body = {"model": "tiny", "prompt": "t5 t6", "max_tokens": max_tokens,
                    "ignore_eos": True, "stream": True}
            lines = []
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                    time.sleep(delay)  # a slow reader keeps the request alive
            results[name] = lines

        threads = [threading.Thread(target=stream, args=("short", 3, 0))] + [
            threading.Thread(target=stream, args=(f"long{i}", 500, 0.01)) for i in range(12)]
        for t in threads:
            t.start()
        start = time.monotonic()
        for at in signals:
            time.sleep(max(0.0, start + at - time.monotonic()))
            proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        # uvicorn re-raises the signal once it has shut down gracefully.
        assert proc.wait(30) in (0, -signal.SIGTERM)
        assert time.monotonic() - start < 20, "a second signal does not wait out the drain"
    finally:
        proc.kill()
    short = results.pop("short")
    assert short[-1] == "data: [DONE]" and json.loads(short[-2][6:])["choices"][0]["finish_reason"]
    assert len(results) == 12
    for lines in results.values():
        assert lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2][6:])
        finished = "choices" in last and last["choices"][0]["finish_reason"] == "length"
        assert finished or ("shut down" in last["error"]["message"] and last["error"]["code"] == 503)


def test_drain_ends_unfinished_requests(chat_model):
    """Shutdown gives running requests the drain window, then ends them with an error;
    new requests are refused."""
    from loraplex.engine.async_engine import AsyncEngine, EngineShutdown

    llm = make_llm(chat_model, max_model_len=512)
    engine = AsyncEngine(llm.engine)

    async def main():
        sp = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
        stream = await engine.submit("long", [5, 6], sp)
        await stream.__anext__()
        shutdown = asyncio.ensure_future(engine.shutdown(drain_timeout=0.05))
        await asyncio.sleep(0.01)
        with pytest.raises(EngineShutdown):
            await engine.submit("late", [5, 6], sp)
        with pytest.raises(EngineShutdown, match="shut down"):
            async for _ in stream:
                pass
        await shutdown

    asyncio.run(main())
    assert not llm.engine.has_unfinished_requests()


def test_default_model_serves_the_demo_adapters(monkeypatch):
    """With no model argument `loraplex serve` serves the default model with the demo
    adapters (unless told otherwise); checked on the parsed flags, without building the
    default model."""
    from loraplex.entrypoints import default_model
    from loraplex.server.run import add_arguments

    monkeypatch.setattr(default_model, "default_model_dir", lambda: Path("/cache/gemma"))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    adapters = dict(default_model.demo_adapters())
    assert set(adapters) == {"terse", "json"}
    for path in adapters.values():
        assert (Path(path) / "adapter_model.safetensors").stat().st_size < 8 * 2**20

    def served(argv):
        args = parser.parse_args(argv)
        default_model.use_default_model(args)
        return args.model, args.served_model_name, args.lora_modules

    demos = [f"{n}={p}" for n, p in adapters.items()]
    assert served([]) == ("/cache/gemma", [default_model.NAME], demos)
    assert served(["--no-demo-adapters"]) == ("/cache/gemma", [default_model.NAME], [])
    assert served(["/some/model"]) == ("/some/model", None, [])
    assert served(["--lora-modules", "mine=/a"]) == ("/cache/gemma", [default_model.NAME], ["mine=/a"])


def test_demo_adapters_fit_the_default_model(tmp_path):
    """The shipped adapters load into a model of Gemma 3 270M's shapes (random weights,
    a small vocabulary: nothing downloaded) and change its output."""
    from transformers import Gemma3TextConfig

    from loraplex.bench.synthetic import write_word_tokenizer
    from loraplex.entrypoints.default_model import demo_adapters

    local, full = "sliding_attention", "full_attention"
    Gemma3TextConfig(
        vocab_size=384, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=512, layer_types=([local] * 5 + [full]) * 3, bos_token_id=1, eos_token_id=2,
        architectures=["Gemma3ForCausalLM"],
    ).save_pretrained(tmp_path)
    write_word_tokenizer(tmp_path, 384, 1, 2)
    llm = make_llm(tmp_path, load_format="dummy", dtype="float32", max_lora_rank=8, max_model_len=64,
                   num_gpu_blocks_override=16)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    loras = [None] + [LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(demo_adapters())]
    outs = llm.generate(["t5 t6 t7"] * len(loras), sp, loras, use_tqdm=False)
    logprobs = [out.outputs[0].cumulative_logprob for out in outs]
    assert len(set(logprobs)) == len(loras), "each adapter changes the output"


def test_prefix_cache_over_http_is_reported_and_kept_per_tenant(server):
    """A repeated long prefix is served from the cache for its tenant (OpenAI's
    usage.prompt_tokens_details.cached_tokens, the receipt, Prometheus), never for
    another tenant."""
    prompt = " ".join(f"t{5 + (i * 13) % 300}" for i in range(40))
    cached = []
    for key in (ACME, ACME, GLOBEX):
        r = client(server, key).completions.create(model="tiny", prompt=prompt + " t7", max_tokens=2)
        assert r.usage.prompt_tokens_details.cached_tokens == r.model_extra["loraplex"]["cached_tokens"]
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
    assert cached[0] == 0 and cached[1] >= 32 and cached[2] == 0
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
    assert "loraplex_prefix_cache_hits_total" in text and "loraplex_prefix_cache_queries_total" in text


def test_penalties_logit_bias_and_min_p_over_http(server):
    c = client(server)
    r = c.completions.create(model="tiny", prompt="t5 t6", max_tokens=4, logit_bias={"17": 100},
                             extra_body={"ignore_eos": True, "min_p": 0.05})
    assert r.choices[0].text.split() == ["t17"] * 4
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "t5 t6"}],
                                     max_tokens=4, presence_penalty=1.0, frequency_penalty=0.5,
                                     extra_body={"repetition_penalty": 1.2})
    assert chat.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        c.completions.create(model="tiny", prompt="t5", max_tokens=2, logit_bias={"seven": 3})


def test_n_samples_stream_interleaved_by_index(server):
    """n = 3 over two prompts: six choices (prompt i's sample j at i * 3 + j), streamed
    interleaved, each the text the same request gives unstreamed; chat too."""
    c = client(server)
    kw = dict(model="tiny", prompt=["t5 t6", "t9"], max_tokens=5, n=3, seed=11, temperature=1.0,
              extra_body={"ignore_eos": True})
    whole = c.completions.create(**kw)
    assert sorted(ch.index for ch in whole.choices) == list(range(6))
    assert whole.usage.completion_tokens == 30
    texts, order = {}, []
    for chunk in c.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            order.append(ch.index)
    assert texts == {ch.index: ch.text for ch in whole.choices}
    assert order != sorted(order), "choices interleave as they progress"
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "t5"}], n=2,
                                     max_tokens=3, seed=4)
    assert [ch.index for ch in chat.choices] == [0, 1]
    best = c.completions.create(model="tiny", prompt="t5", max_tokens=4, n=2, best_of=4, seed=3)
    assert len(best.choices) == 2
