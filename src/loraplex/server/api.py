"""The OpenAI-compatible HTTP API (FastAPI): completions, chat completions, models,
vLLM's adapter endpoints, health and Prometheus metrics.

Every response carries a receipt (`loraplex` in the body; for streams, on the last
chunk): which adapter served the request, where that adapter was when the request
arrived, and the request's queue, first-token and total times and token counts. Every
error, from a bad key to an unknown route or a crash, is a JSON body in OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from loraplex.engine.async_engine import AsyncEngine, EngineShutdown
from loraplex.errors import (
    AdapterError,
    AdapterUnavailable,
    EngineFailure,
    InvalidRequest,
    LoraplexError,
    PromptTooLong,
    RequestFailed,
)
from loraplex.server.auth import Auth, Forbidden, ModelNotFound, ServedModels, Tenant, Unauthorized
from loraplex.server.metrics import Metrics
from loraplex.server.middleware import GuardMiddleware
from loraplex.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    error_body,
)
from loraplex.server.responses import ChoiceState, chat_logprobs, completion_logprobs
from loraplex.server.streaming import JSON, StreamInfo, event_stream, until_done_or_disconnect
from loraplex.server.tools import ToolCallParser, ToolChoiceOutput, parser_for_template
from loraplex.types import LoRARequest, RequestOutput

logger = logging.getLogger("loraplex")

_STATUS = [  # most specific first
    (Unauthorized, 401, "authentication_error"),
    (Forbidden, 403, "permission_error"),
    (ModelNotFound, 404, "not_found_error"),
    (EngineShutdown, 503, "service_unavailable"),
    (EngineFailure, 500, "internal_error"),
    (RequestFailed, 500, "internal_error"),
    (AdapterUnavailable, 503, "service_unavailable"),
    (InvalidRequest, 400, "invalid_request_error"),
    (AdapterError, 400, "invalid_request_error"),
    (LoraplexError, 400, "invalid_request_error"),
]


def status_of(error: Exception) -> tuple[int, str]:
    return next(((c, t) for cls, c, t in _STATUS if isinstance(error, cls)), (500, "internal_error"))


def _error_response(error: Exception) -> JSON:
    code, kind = status_of(error)
    return JSON(error_body(str(error), kind, code, getattr(error, "param", None)), status_code=code)


class Server:
    """What the routes share: the engine, tokenizer, auth, served models, metrics."""

    def __init__(self, engine: AsyncEngine, tokenizer, auth: Auth, served: ServedModels,
                 max_model_len: int, stream_write_timeout: float = 60.0,
                 tool_parser: ToolCallParser | None = None):
        self.engine = engine
        # tool_choice "auto": the format calls are parsed from (None: "auto" is a 400).
        self.tool_parser = tool_parser or parser_for_template(getattr(tokenizer, "chat_template", None))
        self.tokenizer = tokenizer
        self.auth = auth
        self.served = served
        self.max_model_len = max_model_len
        self.stream_write_timeout = stream_write_timeout
        self.metrics = Metrics(engine.engine.stats, lambda: engine.num_in_flight)
        # A text longer than this cannot fit max_model_len tokens (no token spells more
        # characters than the longest in the vocabulary): refused before tokenizing.
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = max_model_len * max(longest, 1)
        # Tokenizing a long text takes seconds: off the event loop, one at a time (a
        # fast tokenizer's state is not meant for concurrent calls).
        self._tokenizing = ThreadPoolExecutor(1, thread_name_prefix="loraplex-tokenize")
        self._loading: set[str] = set()  # adapter names being loaded
        self.replica_name: str | None = None  # named in receipts when one of several replicas

    # -- request preparation ------------------------------------------------------------

    async def tokenize(self, prompt: str | list[int], special_tokens: bool = True
                       ) -> tuple[str | None, list[int]]:
        if not isinstance(prompt, str):
            return None, list(prompt)
        if len(prompt) > self.max_prompt_chars:
            raise PromptTooLong(f"the prompt has {len(prompt)} characters, more than "
                                f"{self.max_model_len} tokens (max_model_len) can hold")
        ids = await asyncio.get_running_loop().run_in_executor(
            self._tokenizing, lambda: self.tokenizer.encode(prompt, add_special_tokens=special_tokens))
        return prompt, ids

    async def chat_prompt(self, body: ChatCompletionRequest) -> tuple[str, list[int]]:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidRequest("this model has no chat template; use /v1/completions")
        messages = [m.template_dict() for m in body.messages]
        text = self.tokenizer.apply_chat_template(messages, tools=body.template_tools(),
                                                  add_generation_prompt=True, tokenize=False)
        return await self.tokenize(text, special_tokens=False)  # the template wrote BOS itself

    def max_tokens(self, requested: int | None, prompt_len: int) -> int:
        room = self.max_model_len - prompt_len
        if room < 1:
            raise PromptTooLong(
                f"This model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has {prompt_len}, leaving no room to generate."
            )
        if requested is None:
            return room
        if requested < 1:
            raise InvalidRequest(f"max_tokens must be at least 1, got {requested}", param="max_tokens")
        if requested > room:
            raise InvalidRequest(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
                f"{requested} for the completion).", param="max_tokens"
            )
        return requested

    async def submit_all(self, endpoint: str, base_id: str, prompts, body, lora: LoRARequest | None,
                         logprobs, tenant: Tenant):
        """Submit every prompt; if one fails, abort those already queued and re-raise.
        Prefix-cache pages are shared within a tenant only (the salt): whether a prompt
        was cached must not tell one tenant what another sent."""
        streams = []
        on_end = lambda outcome, out: self.metrics.record(endpoint, outcome, out)  # noqa: E731
        try:
            for i, (text, ids) in enumerate(prompts):
                sampling = body.sampling_params(self.max_tokens(body.max_tokens, len(ids)), logprobs)
                streams.append(await self.engine.submit(f"{base_id}-{i}", ids, sampling, lora, text,
                                                        cache_salt=tenant.name, on_end=on_end))
        except BaseException:
            for s in streams:
                s.close()
            raise
        return streams

    async def resolve(self, name: str, tenant: Tenant) -> LoRARequest | None:
        """The adapter a request's `model` names (a registry is read off the loop)."""
        if self.served.registry is None:
            return self.served.resolve(name, tenant)
        return await asyncio.to_thread(self.served.resolve, name, tenant)


def _choices(choice, outs: list[RequestOutput], n: int) -> list[dict]:
    """Every sample of every prompt, prompt i's sample j at index i * n + j."""
    return [choice(i * n + c.index, c, c.text, 0, True, True) for i, o in enumerate(outs) for c in o.outputs]


async def _last(stream) -> RequestOutput:
    last = None
    try:
        async for out in stream:
            last = out
    finally:
        stream.close()
    return last


def build_app(server: Server, drain_timeout: float = 30.0, public_metrics: bool = False,
              max_body_bytes: int = 16 * 2**20) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_):
        yield
        await server.engine.shutdown(drain_timeout)  # no-op if a signal already drained

    app = FastAPI(title="loraplex", version="0.1.0", lifespan=lifespan, default_response_class=JSON)
    app.state.server = server
    public = frozenset({"/health", *(["/metrics"] if public_metrics else [])})
    app.add_middleware(GuardMiddleware, auth=server.auth, public_paths=public,
                       max_body_bytes=max_body_bytes)

    def rejected(request: Request) -> None:
        """Count a request refused before it was queued (a queued one is counted when it
        ends: RequestStream's on_end)."""
        endpoint = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}.get(
            request.url.path)
        if endpoint is not None and not getattr(request.state, "queued", False):
            server.metrics.requests.labels(endpoint, "rejected").inc()

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request: Request, exc: RequestValidationError):
        rejected(request)
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        if first.get("type") == "extra_forbidden":
            message = f"{where} is not a field this server knows (unknown fields are refused)"
        elif first.get("type") == "json_invalid":
            message = f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": ")
        else:
            message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "")
        return JSON(error_body(message or "invalid request body", param=where or None), status_code=400)

    @app.exception_handler(LoraplexError)
    async def _typed(request: Request, exc: LoraplexError):
        rejected(request)
        return _error_response(exc)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        # Unknown routes, wrong methods, bodies FastAPI cannot parse (invalid UTF-8,
        # nesting past the parser's depth, integers of thousands of digits).
        rejected(request)
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code,
                                                                          "invalid_request_error")
        message = "There was an error parsing the body" if exc.detail is None else str(exc.detail)
        return JSON(error_body(message, kind, exc.status_code), status_code=exc.status_code,
                    headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return JSON(error_body(f"internal error: {type(exc).__name__}", "internal_error", 500),
                    status_code=500)

    def tenant_of(request: Request) -> Tenant:
        return request.state.tenant  # GuardMiddleware's

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
        for name, adapter in await asyncio.to_thread(server.served.listing, tenant):
            # Tenants never see the server's paths: an adapter's root is its name.
            root = adapter.lora.lora_path if adapter and tenant.admin else name
            data.append({"id": name, "object": "model", "created": 0, "owned_by": "loraplex",
                         "root": root, "parent": base if adapter else None})
        return {"object": "list", "data": data}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request):
        if not tenant_of(request).admin:
            raise Forbidden("only an admin key may load adapters")
        name = body.lora_name
        if name in server.served.adapters or name in server.served.base_names or name in server._loading:
            raise InvalidRequest(f"an adapter named {name!r} is already loaded", param="lora_name")
        server._loading.add(name)  # concurrent loads of one name: the first wins
        try:
            adapter = server.served.new_adapter(name, body.lora_path, body.tenant)
            # Read and validated on the loader threads: the engine keeps stepping meanwhile.
            loading = await server.engine.call(lambda e: e.prefetch_adapter(adapter.lora))
            await asyncio.wrap_future(loading)
            server.served.adapters[name] = adapter
        finally:
            server._loading.discard(name)
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

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
        lora = await server.resolve(body.model, tenant)
        prompts = [await server.tokenize(p) for p in body.prompts()]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await server.submit_all("completions", request_id, prompts, body, lora, body.logprobs,
                                          tenant)
        request.state.queued = True
        info = StreamInfo(request_id, int(time.time()), body.model, "text_completion", lora,
                          body.include_usage, server.replica_name)
        k = body.logprobs

        n = body.n

        def choice(i: int, c, text: str, first_token: int, first: bool, finished: bool) -> dict:
            echo = (prompts[i // n][0] or "") if body.echo and first else ""
            return {"index": i, "text": echo + text,
                    "logprobs": completion_logprobs(c, first_token, k) if k is not None else None,
                    "finish_reason": c.finish_reason if finished else None,
                    "stop_reason": c.stop_reason if finished else None}

        if body.stream:
            states = [ChoiceState(i, body.stop, k) for i in range(len(streams) * n)]
            return await event_stream(request, info, streams, states, choice, status_of,
                                      server.stream_write_timeout)
        outs = await until_done_or_disconnect(request, asyncio.gather(*(_last(s) for s in streams)))
        return info.body(_choices(choice, outs, n), outs)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        tenant = tenant_of(request)
        lora = await server.resolve(body.model, tenant)
        if body.max_completion_tokens is not None and body.max_tokens is None:
            body.max_tokens = body.max_completion_tokens
        tools = body.tool_mode(server.tool_parser)
        prompts = [await server.chat_prompt(body)]
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        k = body.num_logprobs()
        streams = await server.submit_all("chat", request_id, prompts, body, lora, k, tenant)
        request.state.queued = True
        info = StreamInfo(request_id, int(time.time()), body.model,
                          "chat.completion.chunk" if body.stream else "chat.completion", lora,
                          body.include_usage, server.replica_name)

        calls = {}  # choice index -> its ToolChoiceOutput

        def choice(i: int, c, text: str, first_token: int, first: bool, finished: bool) -> dict:
            message = {"role": "assistant"} if first else {}
            reason = c.finish_reason if finished else None
            if tools is None:
                message["content"] = text
            else:
                out = calls.setdefault(i, ToolChoiceOutput(tools))
                out.text += text
                content, tool_calls = (out.delta(out.text, finished) if body.stream
                                       else out.message(out.text))
                message["content"] = content
                if tool_calls:
                    message["tool_calls"] = tool_calls
                    if tools.kind != "named" and reason == "stop":
                        reason = "tool_calls"  # (a named call ends with "stop", as OpenAI's do)
            return {"index": i, ("delta" if body.stream else "message"): message,
                    "logprobs": chat_logprobs(c, first_token, k) if k is not None else None,
                    "finish_reason": reason, "stop_reason": c.stop_reason if finished else None}

        if body.stream:
            states = [ChoiceState(j, body.stop, k) for j in range(body.n)]
            return await event_stream(request, info, streams, states, choice, status_of,
                                      server.stream_write_timeout)
        out = await until_done_or_disconnect(request, _last(streams[0]))
        return info.body(_choices(choice, [out], body.n), [out])

    return app
