"""What a hostile client or a careless one must not be able to do to the server: end
another tenant's requests, grow its memory, read what it may not see, get anything but a
clean error in OpenAI's shape. Each test here failed before the fix it checks."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import threading
import time

import httpx
import openai
import pytest
from conftest import make_llm
from serving import ACME, ADMIN, GLOBEX, KEYS, client, idle, running, serve_args, tenant_serve_args

from loraplex import SamplingParams

AUTH = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def server(chat_model, adapter_dirs, tmp_path_factory):
    args = tenant_serve_args(chat_model, adapter_dirs, tmp_path_factory.mktemp("keys"),
                             "--stream-write-timeout", "1", "--max-request-bytes", str(2**20))
    args[args.index("--max-model-len") + 1] = "4096"  # room for long streams
    yield from running(args)


def post(server, path, body=None, key=ADMIN, **kwargs):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, headers=headers, json=body, timeout=30, **kwargs)


def assert_openai_error(r, status):
    assert r.status_code == status, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    return error


# -- 1. one tenant's values never end another tenant's requests -------------------------

BAD_VALUES = [
    {"seed": 18446744073709551616, "temperature": 1.0},
    {"seed": -(2**63) - 1, "temperature": 1.0},
    {"seed": 1e30, "temperature": 1.0},
    {"stop_token_ids": [100000], "min_tokens": 2, "temperature": 0.5},
    {"stop_token_ids": [-3], "min_tokens": 2},
]


def test_values_that_would_fail_a_step_are_400s_and_others_finish(server):
    async def long_stream():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=ACME, max_retries=0)
        text, finish = "", None
        stream = await c.completions.create(model="acme-ad", prompt="t5 t6", max_tokens=300,
                                            stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return finish

    async def hostile():
        async with httpx.AsyncClient(timeout=30) as h:
            await asyncio.sleep(0.3)  # the long stream is running
            codes = []
            for values in BAD_VALUES:
                r = await h.post(server.url + "/v1/completions",
                                 headers={"Authorization": f"Bearer {GLOBEX}"},
                                 json={"model": "tiny", "prompt": "t5", "max_tokens": 5, **values})
                codes.append((r.status_code, r.json()["error"]["type"]))
            return codes

    async def main():
        return await asyncio.gather(long_stream(), hostile())

    finish, codes = asyncio.run(main())
    assert codes == [(400, "invalid_request_error")] * len(BAD_VALUES)
    assert finish == "length", "the other tenant's stream ran to its end"


# -- 2. a client that stops reading holds bounded memory, then is cut off ----------------

def test_a_client_that_stops_reading_is_disconnected_and_its_request_aborted(server):
    before = _metric(server, 'loraplex_requests_total{endpoint="completions",outcome="aborted"}')
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: fills fast
    host, port = server.url.removeprefix("http://").split(":")
    sock.connect((host, int(port)))
    # 8 choices with 20 logprobs each: ~6 KB a step, 4,000 steps, far past what loopback's
    # send buffer grows to (4 MB), which one choice's whole stream could fit in.
    body = json.dumps({"model": "tiny", "prompt": "t5 t6", "max_tokens": 4000, "logprobs": 20, "n": 8,
                       "stream": True, "ignore_eos": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + ADMIN.encode() + b"\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    try:  # never read: the server must abort it (long before its 4,000 tokens)
        deadline = time.monotonic() + 20
        while server.engine.num_in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert idle(server, timeout=20), "a stalled stream must be aborted"
    finally:
        sock.close()
    assert _metric(server, 'loraplex_requests_total{endpoint="completions",outcome="aborted"}') == before + 1
    # (A GPU may finish all 4,000 tokens before the stall is noticed: the stream is cut
    # off all the same.)
    assert _metric(server, "loraplex_aborted_generation_tokens_total") > 0


def test_a_reader_that_falls_behind_gets_the_newest_output(chat_model):
    """Outputs are cumulative: a stream holds only the newest, however far its reader
    falls behind (before, every step's output queued up until read)."""
    from loraplex.engine.async_engine import AsyncEngine

    engine = AsyncEngine(make_llm(chat_model, max_model_len=512).engine)

    async def main():
        sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, logprobs=5)
        stream = await engine.submit("r", [5, 6], sp)
        while engine.engine.has_unfinished_requests():
            await asyncio.sleep(0.01)  # not reading while it generates
        await asyncio.sleep(0.05)
        first = await stream.__anext__()
        return first

    first = asyncio.run(main())
    assert first.finished and len(first.outputs[0].token_ids) == 200
    asyncio.run(engine.shutdown(0))


def _metric(server, name: str) -> float:
    """A sample's value on /metrics (0 if absent)."""
    text = httpx.get(server.url + "/metrics", headers=AUTH).text
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return float(samples.get(name, 0.0))


# -- 3. non-finite numbers never reach JSON ----------------------------------------------

def test_non_finite_numbers_are_never_written():
    from loraplex.server.streaming import JSON, dumps

    data = {"logprobs": {"token_logprobs": [float("-inf"), float("nan"), -0.5]}}
    for text in (dumps(data), JSON(data).body.decode()):
        assert json.loads(text)["logprobs"]["token_logprobs"] == [-9999.0, -9999.0, -0.5]
        assert "NaN" not in text and "Infinity" not in text


# -- 6. registry adapters have owners; "private" and "missing" look and cost the same ----

@pytest.fixture(scope="module")
def registry_server(chat_model, adapter_dirs, tmp_path_factory):
    from loraplex.adapters.registry import Registry

    root = tmp_path_factory.mktemp("registry")
    registry = Registry(str(root))
    ads = adapter_dirs["qwen3"]
    registry.publish("acme-reg", ads["qv-r4-rslora"], owner="acme")
    registry.publish("pub-reg", ads["all7-r8"], owner=None)
    registry.publish("old-reg", ads["mlp-o-r16-patterns"], owner=None)
    index = root / "index" / "old-reg.json"  # as written before owners existed
    index.write_text(json.dumps({k: v for k, v in json.loads(index.read_text()).items() if k != "owner"}))
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps(KEYS))
    yield from running(serve_args(
        chat_model, "--served-model-name", "tiny", "--lora-registry", str(root),
        "--api-keys-file", str(keys), "--lora-modules",
        json.dumps({"name": "acme-local", "path": str(ads["all7-r8"]), "tenant": "acme"})))


def test_registry_adapters_are_visible_to_their_owner_only(registry_server):
    listed = {key: {m.id for m in client(registry_server, key).models.list()}
              for key in (ACME, GLOBEX, ADMIN)}
    assert listed[ACME] == {"tiny", "acme-reg", "pub-reg", "acme-local"}
    assert listed[GLOBEX] == {"tiny", "pub-reg"}
    assert listed[ADMIN] == {"tiny", "acme-reg", "pub-reg", "old-reg", "acme-local"}
    for model in ("acme-reg", "pub-reg", "acme-reg@1"):
        assert client(registry_server, ACME).completions.create(model=model, prompt="t5", max_tokens=2)
    assert client(registry_server, ADMIN).completions.create(model="old-reg", prompt="t5", max_tokens=2)
    messages = set()
    for model in ("acme-reg", "acme-reg@1", "old-reg", "acme-local", "no-such-adapter"):
        with pytest.raises(openai.NotFoundError) as e:
            client(registry_server, GLOBEX).completions.create(model=model, prompt="t5", max_tokens=2)
        messages.add(e.value.message.replace(model, "X"))
    assert len(messages) == 1, "private and missing answer alike"


def test_private_and_missing_names_do_the_same_work(registry_server, monkeypatch):
    """The same registry lookups for a name the tenant may not see as for one nobody
    uses: no timing difference to measure (before, a private local name answered
    without asking the registry, measurably faster)."""
    registry = registry_server.served.registry
    calls = []
    lookup = registry.lookup
    monkeypatch.setattr(registry, "lookup", lambda *a: calls.append(a) or lookup(*a))
    work = {}
    for model in ("acme-local", "acme-reg", "no-such-adapter"):
        calls.clear()
        with pytest.raises(openai.NotFoundError):
            client(registry_server, GLOBEX).completions.create(model=model, prompt="t5", max_tokens=2)
        work[model] = len(calls)
    assert work == {"acme-local": 1, "acme-reg": 1, "no-such-adapter": 1}


def test_publish_needs_the_names_owner(adapter_dirs, tmp_path):
    from loraplex.adapters.registry import Registry

    registry = Registry(str(tmp_path))
    ads = adapter_dirs["qwen3"]
    registry.publish("x", ads["all7-r8"], owner="acme")
    with pytest.raises(ValueError, match="acme"):
        registry.publish("x", ads["qv-r4-rslora"], owner="globex")
    with pytest.raises(TypeError):
        registry.publish("y", ads["all7-r8"])  # an owner (or None: public) must be named


# -- 7, 8. every error is a clean 4xx in OpenAI's shape ----------------------------------

SURROGATE_BODIES = [
    ("/v1/completions", {"model": "tiny\ud800", "prompt": "t5"}),
    ("/v1/completions", {"model": "tiny", "prompt": "t5 \ud800"}),
    ("/v1/completions", {"model": "tiny", "prompt": ["t5", "\udfff"]}),
    ("/v1/completions", {"model": "tiny", "prompt": "t5", "stop": ["\ud800"]}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "\ud800"}]}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a\udc00"}]}]}),
    ("/v1/load_lora_adapter", {"lora_name": "x\ud800", "lora_path": "/tmp"}),
]


@pytest.mark.parametrize("path, body", SURROGATE_BODIES)
def test_lone_surrogates_are_400s(server, path, body):
    data = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as \ud800
    r = httpx.post(server.url + path, content=data, headers={**AUTH, "Content-Type": "application/json"})
    assert "Unicode" in assert_openai_error(r, 400)["message"]


def test_a_key_that_is_not_ascii_is_a_401(server):
    for key in (b"sk-\xff\xfe", "sk-ключ".encode()):
        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "t5"},
                       headers={"Authorization": b"Bearer " + key})
        assert_openai_error(r, 401)


UNPARSABLE = [
    ("nested 1,500 deep", b"[" * 1500 + b"]" * 1500),
    ("nested object 5,000 deep", b'{"a":' * 5000 + b"1" + b"}" * 5000),
    ("invalid UTF-8", b'{"model": "tiny", "prompt": "\xff\xfe"}'),
    ("5,000-digit integer", b'{"model": "tiny", "prompt": "t5", "max_tokens": ' + b"9" * 5000 + b"}"),
    ("garbage", bytes(range(256)) * 400),
    ("not an object", b'"just a string"'),
]


@pytest.mark.parametrize("body", [b for _, b in UNPARSABLE], ids=[n for n, _ in UNPARSABLE])
def test_unparsable_bodies_are_400s_in_openai_shape(server, body):
    r = httpx.post(server.url + "/v1/completions", content=body,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert_openai_error(r, 400)


def test_unknown_routes_and_methods_answer_in_openai_shape(server):
    missing = assert_openai_error(httpx.get(server.url + "/v1/nothing", headers=AUTH), 404)
    assert missing["type"] == "not_found_error"
    assert_openai_error(httpx.get(server.url + "/v1/completions", headers=AUTH), 405)


def test_bad_adapter_loads_are_400s(server, tmp_path, adapter_dirs):
    good = adapter_dirs["qwen3"]["all7-r8"]
    cases = {}
    deep = tmp_path / "deep-config"
    shutil.copytree(good, deep)
    (deep / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    cases["config nested 100k deep"] = str(deep)
    for name, patterns in {"rank_pattern list": {"rank_pattern": [1, 2]},
                           "alpha_pattern string": {"alpha_pattern": "q_proj"},
                           "rank_pattern bad regex": {"rank_pattern": {"(": 4}},
                           "lora_alpha NaN": {"lora_alpha": float("nan")},
                           "lora_alpha 1e308": {"lora_alpha": 1e308},
                           "alpha_pattern Infinity": {"alpha_pattern": {"q_proj": float("inf")}}}.items():
        d = tmp_path / name.replace(" ", "-")
        shutil.copytree(good, d)
        config = json.loads((d / "adapter_config.json").read_text())
        (d / "adapter_config.json").write_text(json.dumps({**config, **patterns}))
        cases[name] = str(d)
    cases["path of 100,000 characters"] = "/" + "a" * 100_000
    for i, (name, path) in enumerate(cases.items()):
        r = post(server, "/v1/load_lora_adapter", {"lora_name": f"bad-{i}", "lora_path": path})
        assert r.status_code == 400, (name, r.status_code, r.text[:200])
        assert_openai_error(r, 400)
    assert client(server).completions.create(model="tiny", prompt="t5", max_tokens=2).choices


# -- 9. authentication comes first ------------------------------------------------------

def test_a_request_without_a_key_learns_nothing_of_the_schema(server):
    for body in ({"model": "tiny"}, {"prompt": 5}, b"{not json"):
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = httpx.post(server.url + "/v1/completions", **kwargs)
        assert_openai_error(r, 401)
    for path in ("/metrics", "/openapi.json", "/docs", "/v1/models"):
        assert_openai_error(httpx.get(server.url + path), 401)
        assert httpx.get(server.url + path, headers={"Authorization": f"Bearer {GLOBEX}"}).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200


def test_public_metrics_flag(chat_model, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(KEYS))
    for srv in running(serve_args(chat_model, "--api-keys-file", str(keys), "--public-metrics")):
        assert httpx.get(srv.url + "/metrics").status_code == 200
        assert httpx.get(srv.url + "/v1/models").status_code == 401


def test_tenants_see_no_server_paths(server, adapter_dirs):
    for key in (ACME, GLOBEX):
        for m in client(server, key).models.list():
            assert "/" not in m.model_extra["root"], m
    admin_roots = {m.id: m.model_extra["root"] for m in client(server, ADMIN).models.list()}
    assert admin_roots["public-ad"] == str(adapter_dirs["qwen3"]["all7-r8"])


# -- 10. fields the server does not implement are refused, by name ----------------------

UNSUPPORTED = [  # (field, value, the endpoints that refuse it)
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}], ("completions",)),
    ("tool_choice", "required", ("completions",)),
    ("no_such_field", 1, ("completions", "chat")),
]


@pytest.mark.parametrize("field, value, paths", UNSUPPORTED, ids=[f for f, _, _ in UNSUPPORTED])
def test_unimplemented_fields_are_400s_naming_them(server, field, value, paths):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "t5"}]}
    for path, body in (("completions", {"model": "tiny", "prompt": "t5"}), ("chat", chat)):
        if path in paths:
            url = "/v1/completions" if path == "completions" else "/v1/chat/completions"
            error = assert_openai_error(post(server, url, {**body, "max_tokens": 2, field: value}), 400)
            assert field in error["message"], error


def test_chat_only_fields_and_message_fields(server):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "t5"}], "max_tokens": 2}
    for extra in ({"functions": [{"name": "f"}]}, {"function_call": "auto"}, {"best_of": 3}):
        field = next(iter(extra))
        error = assert_openai_error(post(server, "/v1/chat/completions", {**chat, **extra}), 400)
        assert field in error["message"]
    bad_message = {**chat, "messages": [{"role": "user", "content": "", "tool_calls": []}]}
    error = assert_openai_error(post(server, "/v1/chat/completions", bad_message), 400)
    assert "tool_calls" in error["message"]


def test_neutral_values_and_harmless_fields_are_accepted(server):
    r = post(server, "/v1/completions", {
        "model": "tiny", "prompt": "t5", "max_tokens": 2, "best_of": 1, "logit_bias": {},
        "response_format": {"type": "text"}, "user": "u-1",
        "metadata": {"k": "v"}, "presence_penalty": 0, "frequency_penalty": 0.0})
    assert r.status_code == 200, r.text
    named = post(server, "/v1/chat/completions", {"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "user", "content": "t5", "name": "alice"}], "tools": [], "tool_choice": "none"})
    assert named.status_code == 200, named.text


# -- 11. limits -------------------------------------------------------------------------

def test_a_body_over_the_limit_is_413(server):
    big = {"model": "tiny", "prompt": "t5 " * 400_000}
    assert_openai_error(post(server, "/v1/completions", big), 413)
    chunked = httpx.post(server.url + "/v1/completions", headers={**AUTH, "Content-Type": "application/json"},
                         content=iter([b'{"model": "tiny", "prompt": "'] + [b"t5 " * 10_000] * 50 + [b'"}']))
    assert_openai_error(chunked, 413)


def test_tokenizing_never_stalls_the_event_loop(server, monkeypatch):
    """A prompt far over max_model_len (~900 KB, under the body limit) is refused without
    tokenizing it, and prompts are tokenized off the event loop's thread (before, the
    loop tokenized them itself: health checks waited seconds behind a 10 MB prompt)."""
    tokenizer = server.tokenizer
    calls = []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, **kw: calls.append(
        (len(text), threading.current_thread().name)) or encode(text, **kw))
    error = assert_openai_error(post(server, "/v1/completions", {
        "model": "tiny", "prompt": "t5 t6 t7 " * 100_000, "max_tokens": 2}), 400)
    assert "max_model_len" in error["message"] and calls == []
    ok = post(server, "/v1/completions", {"model": "tiny", "prompt": "t5 t6", "max_tokens": 2})
    assert ok.status_code == 200
    assert calls == [(5, "loraplex-tokenize_0")]


def test_prompts_per_request_are_bounded(server):
    error = assert_openai_error(post(server, "/v1/completions", {"model": "tiny", "prompt": ["t5"] * 1000,
                                                                  "max_tokens": 1}), 400)
    assert "prompts" in error["message"]


def test_concurrent_loads_of_one_name_have_one_winner(server, adapter_dirs):
    path = str(adapter_dirs["qwen3"]["mlp-o-r16-patterns"])

    async def main():
        async with httpx.AsyncClient(timeout=30) as h:
            return await asyncio.gather(*(h.post(server.url + "/v1/load_lora_adapter", headers=AUTH,
                                                 json={"lora_name": "raced", "lora_path": path})
                                          for _ in range(8)))

    codes = sorted(r.status_code for r in asyncio.run(main()))
    assert codes == [200] + [400] * 7, codes
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "raced"}).status_code == 200


# -- 12. disconnects show in the metrics ------------------------------------------------

def test_client_disconnects_are_counted(server):
    name = 'loraplex_requests_total{endpoint="completions",outcome="aborted"}'
    before, tokens = _metric(server, name), _metric(server, "loraplex_aborted_generation_tokens_total")
    body = {"model": "tiny", "prompt": "t5 t6", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 10:
                break
    assert idle(server)
    assert _metric(server, name) == before + 1
    assert _metric(server, "loraplex_aborted_generation_tokens_total") >= tokens + 5


# -- 18. receipts -------------------------------------------------------------------------

def test_every_response_carries_a_full_receipt(server):
    c = client(server)
    r = c.completions.create(model="public-ad", prompt="t5", max_tokens=3)
    receipt = r.model_extra["loraplex"]
    assert receipt["adapter_source"] in ("device", "host") and receipt["adapter_load_ms"] == 0.0
    # ignore_eos: the random model may sample EOS within 3 tokens ("stop", not "length")
    chunks = list(c.completions.create(model="public-ad", prompt="t5", max_tokens=3, stream=True,
                                       extra_body={"ignore_eos": True}))
    assert "loraplex" in chunks[-1].model_extra, "no include_usage: the last chunk has it"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all("loraplex" not in ch.model_extra for ch in chunks[:-1])
    base = c.completions.create(model="tiny", prompt="t5", max_tokens=2).model_extra["loraplex"]
    assert base["adapter"] is None and base["adapter_load_ms"] is None


# -- 4, 11. identity from content ----------------------------------------------------------

def test_an_adapter_is_its_content_not_its_path(server, adapter_dirs, tmp_path):
    """Files changed in place are new weights under a new name, while the first name
    keeps what it loaded, even once its directory is gone (before, the new name served
    the old weights: identity came from the path)."""
    ads = adapter_dirs["qwen3"]
    path = tmp_path / "ad"
    shutil.copytree(ads["all7-r8"], path)
    def load(name, adapter_path):
        r = post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapter_path)})
        assert r.status_code == 200, r.text

    load("first", path)
    c = client(server)

    def ask(model):
        r = c.completions.create(model=model, prompt="t5 t6 t7", max_tokens=4, temperature=0,
                                 extra_body={"ignore_eos": True})
        return r.choices[0].text, r.model_extra["loraplex"]["adapter_content_id"]

    first = ask("first")
    shutil.rmtree(path)
    shutil.copytree(ads["mlp-o-r16-patterns"], path)  # recreated with other weights
    load("second", path)
    load("other", ads["mlp-o-r16-patterns"])
    second, other = ask("second"), ask("other")
    assert second == other and second[1] != first[1]
    shutil.rmtree(path)
    assert ask("first") == first, "its content is in memory: served as loaded"
    for name in ("first", "second", "other"):
        assert post(server, "/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200
