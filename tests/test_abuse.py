"""The abuse suite: hostile and malformed traffic against a real server, with a tenant's
stream running through all of it.

- schemathesis generates requests from the server's own /openapi.json, valid and not,
  for every route (bounded counts, so it fits CI);
- hypothesis throws extreme values at every sampling field of both completion routes;
- raw sockets send what no HTTP client would (broken request lines, lying lengths,
  header floods, half requests, pipelining);
- the official openai client opens and abandons streams by the hundred.

Every case must end in a 2xx or a JSON error in OpenAI's shape, never a 5xx; the server
must keep answering, and the other tenant's stream must end complete. The suite ends
with a count of the cases it tried and those that failed (`pytest_terminal_summary` in
conftest prints it).
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time
from collections import Counter

import httpx
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving import ACME, ADMIN, GLOBEX, client, idle, running, tenant_serve_args

TALLY: Counter = Counter()  # "<kind> tried" / "<kind> failed"; read by conftest's summary


@pytest.fixture(scope="module")
def server(chat_model, adapter_dirs, tmp_path_factory):
    yield from running(tenant_serve_args(chat_model, adapter_dirs, tmp_path_factory.mktemp("keys"),
                                         "--stream-write-timeout", "2", "--max-request-bytes", str(2**20)))


@pytest.fixture(scope="module")
def bystander(server):
    """A well-behaved tenant that keeps streaming requests while the abuse happens; yields
    a function that stops it and returns each of its requests' (finish_reason, tokens)."""
    results, stop = [], threading.Event()

    def run():
        while not stop.is_set():
            finish, tokens = None, None
            try:
                stream = client(server, ACME).completions.create(
                    model="acme-ad", prompt="t5 t6", max_tokens=40, stream=True,
                    extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
                for chunk in stream:
                    if chunk.choices:
                        finish = chunk.choices[0].finish_reason or finish
                    if chunk.usage:
                        tokens = chunk.usage.completion_tokens
            except openai.APIError as e:
                finish = repr(e)
            results.append((finish, tokens))

    thread = threading.Thread(target=run)
    thread.start()

    def finish():
        stop.set()
        thread.join(120)
        return results

    yield finish
    finish()


def check(kind: str, condition: bool, detail: str) -> None:
    TALLY[f"{kind} tried"] += 1
    if not condition:
        TALLY[f"{kind} failed"] += 1
        raise AssertionError(f"{kind}: {detail}")


def check_response(kind: str, status: int, body: bytes, content_type: str) -> None:
    """A 2xx, or an error body in OpenAI's shape with a 4xx (or 503) status."""
    if 200 <= status < 300:
        return check(kind, True, "")
    ok = status < 500 or status == 503
    try:
        error = json.loads(body)["error"]
        shaped = set(error) == {"message", "type", "param", "code"} and error["code"] == status
    except (ValueError, KeyError, TypeError):
        shaped = False
    check(kind, ok and shaped and content_type.startswith("application/json"),
          f"{status} {content_type} {body[:200]!r}")


def only_bystander(server, timeout: float = 20.0) -> bool:
    """Nothing in flight but the bystander's one request."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.engine.num_in_flight <= 1 and len(server.engine.engine.scheduler.requests) <= 1:
            return True
        time.sleep(0.02)
    return False


def still_serving(server) -> None:
    r = client(server, GLOBEX).completions.create(model="tiny", prompt="t5", max_tokens=2)
    check("server still answers", len(r.choices[0].text) >= 0, "no answer")


# -- schemathesis: every route, from the server's own schema ------------------------------

@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json",
                                         headers={"Authorization": f"Bearer {ADMIN}"})


WITH_BODY = ["POST /v1/completions", "POST /v1/chat/completions", "POST /v1/load_lora_adapter",
             "POST /v1/unload_lora_adapter"]
# Valid requests everywhere; invalid ones where there is an input to get wrong.
CASES = [(label, schemathesis.GenerationMode.POSITIVE)
         for label in [*WITH_BODY, "GET /v1/models", "GET /health", "GET /metrics"]] + [
    (label, schemathesis.GenerationMode.NEGATIVE) for label in WITH_BODY]


@pytest.mark.parametrize("label, mode", CASES, ids=[f"{label} {mode.value}" for label, mode in CASES])
def test_generated_requests_get_2xx_or_openai_errors(server, bystander, api_schema, label, mode):
    operation = api_schema.find_operation_by_label(label)
    assert operation is not None, f"{label} is not in /openapi.json"
    keys = random.Random(label).choices([ADMIN, ACME, GLOBEX, "sk-unknown"], k=1000)

    @settings(max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case):
        key = keys[TALLY[f"schemathesis {label} tried"] % len(keys)]
        response = case.call(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        content_type = response.headers.get("content-type") or [""]  # a list per header
        check_response(f"schemathesis {label}", response.status_code, response.content, content_type[0])

    run()
    still_serving(server)


# -- hypothesis: extreme values in every sampling field -----------------------------------

JSON_SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
                | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
EXTREME_NUMBERS = st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30, 1e308, -1e308,
                                   1e-320, 0.5, 1.5, 100000, 383, 384])
FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop", "stop_token_ids",
          "min_tokens", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
          "stream", "stream_options", "echo", "best_of", "logit_bias", "user", "suffix"]


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(chat=st.booleans(), fields=st.dictionaries(
    st.sampled_from(FIELDS), JSON_VALUES | EXTREME_NUMBERS | st.lists(EXTREME_NUMBERS, max_size=3),
    min_size=1, max_size=5))
def test_extreme_sampling_values_never_fail_the_server(server, bystander, chat, fields):
    body = {"model": "tiny", "max_tokens": 4, **fields}
    if chat:
        body["messages"] = [{"role": "user", "content": "t5 t6"}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = "t5 t6"
        path = "/v1/completions"
    try:
        data = json.dumps(body).encode()  # NaN / Infinity travel as Python's json writes them
    except ValueError:
        return
    r = httpx.post(server.url + path, content=data, timeout=60,
                   headers={"Authorization": f"Bearer {GLOBEX}", "Content-Type": "application/json"})
    check_response(f"hypothesis {path}", r.status_code, r.content, r.headers.get("content-type", ""))
    if r.status_code == 200 and body.get("stream") is True:
        check("hypothesis stream ends", r.text.rstrip().endswith("data: [DONE]"), r.text[-200:])


# -- raw sockets: what no HTTP client sends -----------------------------------------------

def _raw(server, payload: bytes, read_timeout: float = 5.0, close_early: bool = False) -> bytes:
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=read_timeout) as sock:
        sock.sendall(payload)
        if close_early:
            return b""
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # the server already answered and closed (e.g. a header too large)
            pass
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except (TimeoutError, ConnectionResetError):
            pass
        return b"".join(chunks)


def _request(body: bytes, key: str = ADMIN, path: str = "/v1/completions", extra: bytes = b"",
             length: int | None = None) -> bytes:
    n = len(body) if length is None else length
    return (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + key.encode() + b"\r\n" + extra
            + b"Content-Length: " + str(n).encode() + b"\r\n\r\n" + body)


GOOD = json.dumps({"model": "tiny", "prompt": "t5", "max_tokens": 2}).encode()
RAW_CASES = {
    "garbage request line": b"\x00\xff\xfe GARBAGE\r\n\r\n",
    "no HTTP version": b"POST /v1/completions\r\n\r\n",
    "HTTP/0.9": b"GET /health\r\n",
    "HTTP/1.0": b"GET /health HTTP/1.0\r\n\r\n",
    "header without colon": b"GET /health HTTP/1.1\r\nHost x\r\n\r\n",
    "header flood": b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-A: b\r\n" * 5000 + b"\r\n",
    "huge header": b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n",
    "length larger than body": _request(GOOD, length=len(GOOD) + 100),
    "length smaller than body": _request(GOOD, length=5),
    "negative length": _request(GOOD, length=-5),
    "length not a number": _request(GOOD).replace(b"Content-Length: " + str(len(GOOD)).encode(),
                                                  b"Content-Length: ten"),
    "two lengths": _request(GOOD, extra=b"Content-Length: 3\r\n"),
    "chunked garbage": (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                        + ADMIN.encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\nabc\r\n0\r\n\r\n"),
    "pipelined": _request(GOOD) * 3,
    "key with control bytes": _request(GOOD, key="sk-\x01\x7f"),
    "bearer only": _request(GOOD).replace(b"Bearer " + ADMIN.encode(), b"Bearer"),
    "json with NaN and Infinity": _request(
        b'{"model": "tiny", "prompt": "t5", "temperature": NaN, "top_p": Infinity}'),
    "body of zeros": _request(b"\x00" * 10_000),
    "deep JSON": _request(b"[" * 100_000 + b"]" * 100_000),
}


@pytest.mark.parametrize("name", list(RAW_CASES))
def test_raw_http_abuse(server, bystander, name):
    reply = _raw(server, RAW_CASES[name])
    status_line = reply.split(b"\r\n", 1)[0]
    if status_line.startswith(b"HTTP/1."):
        status = int(status_line.split()[1])
        head, _, body = reply.partition(b"\r\n\r\n")
        if head.lower().find(b"content-type: application/json") >= 0 or status >= 500:
            check_response(f"raw {name}", status, body.split(b"HTTP/1.1")[0] if name == "pipelined" else body,
                           "application/json" if b"application/json" in head.lower() else "")
        else:  # uvicorn's own answer to broken HTTP (400 with text), before any route
            check(f"raw {name}", status < 500, reply[:200].decode(errors="replace"))
    else:  # the connection was closed without an answer: fine for broken HTTP
        check(f"raw {name}", True, "")
    still_serving(server)


def test_half_requests_and_early_closes(server, bystander):
    """Requests that stop halfway (headers only, half a body) and connections closed at
    once, many of them: the server frees them and keeps serving."""
    for i in range(40):
        payload = _request(GOOD)
        cut = payload[: random.Random(i).randrange(1, len(payload))]
        _raw(server, cut, read_timeout=0.2, close_early=i % 2 == 0)
        check("raw half request", True, "")
    still_serving(server)
    check("raw half requests leave nothing running", only_bystander(server), "requests left in flight")


# -- the openai client: streams opened and abandoned by the hundred -----------------------

def test_abandoned_streams(server, bystander):
    async def one(c, i):
        stream = await c.completions.create(
            model=["tiny", "public-ad"][i % 2], prompt=f"t{5 + i % 40} t6", max_tokens=60, stream=True,
            extra_body={"ignore_eos": True}, logprobs=5)
        n = 0
        async for _ in stream:
            n += 1
            if n >= i % 7:
                break  # leave mid-stream
        await stream.close()

    async def main():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=GLOBEX, max_retries=0,
                               http_client=openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=200)))
        return await asyncio.gather(*(one(c, i) for i in range(200)), return_exceptions=True)

    for result in asyncio.run(main()):
        check("abandoned stream", not isinstance(result, Exception), repr(result))
    still_serving(server)
    check("abandoned streams leave nothing running", only_bystander(server), "requests left in flight")


def test_the_bystander_finished_untouched(server, bystander):
    """Runs last in this module: every request of the tenant that kept streaming through
    all of the above ended complete."""
    results = bystander()
    check("bystander requests ran", len(results) >= 3, f"{len(results)}")
    for finish, tokens in results:
        check("bystander request", (finish, tokens) == ("length", 40), f"{finish} {tokens}")
    check("server idle at the end", idle(server, timeout=20), "requests left in flight")
