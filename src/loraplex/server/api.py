"""The OpenAI-compatible HTTP API (FastAPI): completions, chat completions, models,
vLLM's adapter endpoints, health and Prometheus metrics.

Every response carries a receipt (`loraplex` in the body; for streams, in the final usage
chunk): which adapter served the request, where that adapter was when the request
arrived, and the request's queue, first-token and total times and token counts.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from loraplex.engine.async_engine import AsyncEngine, EngineFailure, EngineShutdown
from loraplex.errors import AdapterError, AdapterUnavailable, InvalidRequest, LoraplexError
from loraplex.server.auth import Auth, Forbidden, ModelNotFound, ServedModels, Tenant, Unauthorized
from loraplex.server.metrics import Metrics
from loraplex.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    error_body,
)
from loraplex.server.responses import ChoiceState, chat_logprobs, completion_logprobs, receipt, usage
from loraplex.types import LoRARequest, RequestOutput

_STATUS = [  # most specific first
    (Unauthorized, 401, "authentication_error"),
    (Forbidden, 403, "permission_error"),
    (ModelNotFound, 404, "not_found_error"),
    (EngineShutdown, 503, "service_unavailable"),
    (EngineFailure, 500, "internal_error"),
    (AdapterUnavailable, 503, "service_unavailable"),
    (InvalidRequest, 400, "invalid_request_error"),
    (AdapterError, 400, "invalid_request_error"),
    (LoraplexError, 400, "invalid_request_error"),
]


def _status_of(error: Exception) -> tuple[int, str]:
    return next(((c, t) for cls, c, t in _STATUS if isinstance(error, cls)), (500, "internal_error"))


def _error_response(error: Exception) -> JSONResponse:
    code, kind = _status_of(error)
    return JSONResponse(error_body(str(error), kind, code), status_code=code)


class Server:
    """What the routes share: the engine, tokenizer, auth, served models, metrics."""

    def __init__(self, engine: AsyncEngine, tokenizer, auth: Auth, served: ServedModels,
                 max_model_len: int):
        self.engine = engine
        self.tokenizer = tokenizer
        self.auth = auth
        self.served = served
        self.max_model_len = max_model_len
        self.metrics = Metrics(engine.engine.stats, lambda: engine.num_in_flight)

    # -- request preparation ------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def chat_prompt(self, body: ChatCompletionRequest) -> tuple[str, list[int]]:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidRequest("this model has no chat template; use /v1/completions")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # The template writes the special tokens (BOS) itself.
        return text, self.tokenizer.encode(text, add_special_tokens=False)

    def max_tokens(self, requested: int | None, prompt_len: int) -> int:
        room = self.max_model_len - prompt_len
        if room < 1:
            raise InvalidRequest(
                f"This model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has {prompt_len}, leaving no room to generate."
            )
        if requested is None:
            return room
        if requested < 1:
            raise InvalidRequest(f"max_tokens must be at least 1, got {requested}")
        if requested > room:
            raise InvalidRequest(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
                f"{requested} for the completion)."
            )
        return requested

    async def submit_all(self, base_id: str, prompts, body, lora: LoRARequest | None, logprobs):
        """Submit every prompt; if one fails, abort those already queued and re-raise."""
        streams = []
        try:
            for i, (text, ids) in enumerate(prompts):
                sampling = body.sampling_params(self.max_tokens(body.max_tokens, len(ids)), logprobs)
                streams.append(await self.engine.submit(f"{base_id}-{i}", ids, sampling, lora, text))
        except BaseException:
            for s in streams:
                s.close()
            raise
        return streams

    def finish(self, endpoint: str, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            reason = out.outputs[0].finish_reason
            self.metrics.requests.labels(endpoint, "aborted" if reason == "abort" else "ok").inc()
            self.metrics.observe(out)


async def _until_done_or_disconnect(request: Request, coro):
    """Await coro, cancelling it (and so aborting its requests) if the client leaves."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.2)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise asyncio.CancelledError("client disconnected")
    finally:
        if not task.done():
            task.cancel()


async def _last(stream) -> RequestOutput:
    last = None
    try:
        async for out in stream:
            last = out
    finally:
        stream.close()
    return last


def build_app(server: Server, drain_timeout: float = 30.0) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_):
        yield
        await server.engine.shutdown(drain_timeout)  # no-op if a signal already drained

    app = FastAPI(title="loraplex", version="0.1.0", lifespan=lifespan)
    app.state.server = server

    def rejected(request: Request) -> None:
        endpoint = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}.get(
            request.url.path)
        if endpoint is not None:
            server.metrics.requests.labels(endpoint, "rejected").inc()

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request: Request, exc: RequestValidationError):
        rejected(request)
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "")
        return JSONResponse(error_body(message or "invalid request body", param=where or None),
                            status_code=400)

    @app.exception_handler(LoraplexError)
    async def _typed(request: Request, exc: LoraplexError):
        rejected(request)
        return _error_response(exc)

    def tenant_of(request: Request) -> Tenant:
        return server.auth.authenticate(request.headers.get("authorization"))

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        tenant = tenant_of(request)
        base = server.served.base_names[0]
        data = []
        for name, adapter in server.served.listing(tenant):
            entry = {"id": name, "object": "model", "created": 0, "owned_by": "loraplex",
                     "root": adapter.lora.lora_path if adapter else name,
                     "parent": base if adapter else None}
            data.append(entry)
        return {"object": "list", "data": data}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request):
        if not tenant_of(request).admin:
            raise Forbidden("only an admin key may load adapters")
        if body.lora_name in server.served.adapters or body.lora_name in server.served.base_names:
            raise InvalidRequest(f"an adapter named {body.lora_name!r} is already loaded")
        adapter = server.served.new_adapter(body.lora_name, body.lora_path, body.tenant)
        # Read and validated on the loader threads: the engine keeps stepping meanwhile.
        loading = await server.engine.call(lambda e: e.prefetch_adapter(adapter.lora))
        await asyncio.wrap_future(loading)
        server.served.adapters[body.lora_name] = adapter
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.",
                        media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request):
        if not tenant_of(request).admin:
            raise Forbidden("only an admin key may unload adapters")
        adapter = server.served.adapters.pop(body.lora_name, None)
        if adapter is None:
            raise ModelNotFound(body.lora_name)
        await server.engine.call(lambda e: e.unload_adapter(adapter.lora))
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.",
                        media_type="text/plain")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        tenant = tenant_of(request)
        lora = server.served.resolve(body.model, tenant)
        if body.suffix:
            raise InvalidRequest("suffix is not supported")
        prompts = [server.tokenize(p) for p in body.prompts()]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await server.submit_all(request_id, prompts, body, lora, body.logprobs)
        info = _StreamInfo("completions", request_id, int(time.time()), body.model,
                           "text_completion", lora, body.include_usage)
        k = body.logprobs

        def choice(i: int, c, text: str, first_token: int, first: bool, finished: bool) -> dict:
            echo = (prompts[i][0] or "") if body.echo and first else ""
            return {"index": i, "text": echo + text,
                    "logprobs": completion_logprobs(c, first_token, k) if k is not None else None,
                    "finish_reason": c.finish_reason if finished else None,
                    "stop_reason": c.stop_reason if finished else None}

        if body.stream:
            states = [ChoiceState(i, body.stop, k) for i in range(len(streams))]
            return await _event_stream(request, server, info, streams, states, choice)
        outs = await _until_done_or_disconnect(request, asyncio.gather(*(_last(s) for s in streams)))
        server.finish(info.endpoint, outs)
        choices = [choice(i, o.outputs[0], o.outputs[0].text, 0, True, True) for i, o in enumerate(outs)]
        return info.body(choices, outs)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        tenant = tenant_of(request)
        lora = server.served.resolve(body.model, tenant)
        if body.max_completion_tokens is not None and body.max_tokens is None:
            body.max_tokens = body.max_completion_tokens
        prompts = [server.chat_prompt(body)]
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        k = body.num_logprobs()
        streams = await server.submit_all(request_id, prompts, body, lora, k)
        info = _StreamInfo("chat", request_id, int(time.time()), body.model,
                           "chat.completion.chunk" if body.stream else "chat.completion", lora,
                           body.include_usage)

        def choice(i: int, c, text: str, first_token: int, first: bool, finished: bool) -> dict:
            message = {"role": "assistant", "content": text} if first else {"content": text}
            return {"index": i, ("delta" if body.stream else "message"): message,
                    "logprobs": chat_logprobs(c, first_token, k) if k is not None else None,
                    "finish_reason": c.finish_reason if finished else None,
                    "stop_reason": c.stop_reason if finished else None}

        if body.stream:
            return await _event_stream(request, server, info, streams,
                                       [ChoiceState(0, body.stop, k)], choice)
        out = await _until_done_or_disconnect(request, _last(streams[0]))
        server.finish(info.endpoint, [out])
        return info.body([choice(0, out.outputs[0], out.outputs[0].text, 0, True, True)], [out])

    return app


@dataclass
class _StreamInfo:
    """What every chunk or body of one response repeats."""

    endpoint: str
    request_id: str
    created: int
    model: str
    object: str
    lora: LoRARequest | None
    include_usage: bool

    def body(self, choices: list[dict], outs: list[RequestOutput]) -> dict:
        return {"id": self.request_id, "object": self.object, "created": self.created,
                "model": self.model, "choices": choices, "usage": usage(outs),
                "loraplex": receipt(self.request_id, self.lora, outs)}

    def chunk(self, choices: list[dict]) -> dict:
        return {"id": self.request_id, "object": self.object, "created": self.created,
                "model": self.model, "choices": choices}


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def _merged(streams):
    """Yield (choice index, output) from several request streams as outputs arrive."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for out in stream:
                await queue.put((i, out, None))
        except Exception as e:
            await queue.put((i, None, e))
        await queue.put((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(streams)
        while live:
            i, out, error = await queue.get()
            if error is not None:
                raise error
            if out is None:
                live -= 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()


async def _event_stream(request: Request, server: Server, info: _StreamInfo, streams, states,
                        choice) -> StreamingResponse:
    """Server-sent events: a chunk per new text, then usage + receipt, then [DONE].

    The first output is awaited before the response starts, so an error before it (an
    adapter that failed to load) gets its own HTTP status; an error after the first
    chunk is reported as an error event before [DONE]."""
    merged = _merged(streams)
    try:
        first = await _until_done_or_disconnect(request, anext(merged, None))
    except BaseException:
        for s in streams:
            s.close()
        raise

    async def outputs():
        if first is not None:
            yield first
            async for item in merged:
                yield item

    async def events():
        finals = []
        try:
            async for i, out in outputs():
                delta = states[i].advance(out)
                if delta is not None:
                    c = out.outputs[0]
                    yield _sse(info.chunk([choice(i, c, delta.text, delta.first_token,
                                                  delta.first, out.finished)]))
                if out.finished:
                    finals.append(out)
            server.finish(info.endpoint, finals)
            if info.include_usage:
                yield _sse({**info.chunk([]), "usage": usage(finals),
                            "loraplex": receipt(info.request_id, info.lora, finals)})
        except LoraplexError as e:
            server.metrics.requests.labels(info.endpoint, "error").inc()
            code, kind = _status_of(e)
            yield _sse(error_body(str(e), kind, code))
        finally:
            for s in streams:
                s.close()
        yield _sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream")
