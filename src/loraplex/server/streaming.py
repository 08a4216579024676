"""Server-sent event streams of completions, and the JSON every response is written in.

A stream is one chunk per new text, then (with include_usage) a usage chunk; the last
chunk carries the receipt; `data: [DONE]` ends it, after an error event if the request
failed. A client that accepts no bytes for `write_timeout` seconds is disconnected and
its request aborted: the request streams (engine/async_engine.py) hold one pending
output each, however slowly a client reads, and this bounds how long a stalled one
keeps its sequence.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from dataclasses import dataclass

import anyio
from fastapi.responses import JSONResponse, StreamingResponse

from loraplex.errors import LoraplexError
from loraplex.server.protocol import error_body
from loraplex.server.responses import ChoiceState, receipt, usage
from loraplex.types import LoRARequest, RequestOutput

logger = logging.getLogger("loraplex")


def dumps(data) -> str:
    """JSON text; non-finite numbers (which JSON has no words for) never leave: a
    logprob of -inf or NaN is written as -9999.0, as vLLM does."""
    try:
        return json.dumps(data, ensure_ascii=False, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(data), ensure_ascii=False, allow_nan=False)


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return -9999.0
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


class JSON(JSONResponse):
    """Every JSON body the server writes (see dumps)."""

    def render(self, content) -> bytes:
        return dumps(content).encode("utf-8")


@dataclass
class StreamInfo:
    """What every chunk or body of one response repeats."""

    request_id: str
    created: int
    model: str
    object: str
    lora: LoRARequest | None
    include_usage: bool
    replica: str | None = None  # the replica that served it, behind an ingress

    def receipt(self, outs: list[RequestOutput]) -> dict:
        return receipt(self.request_id, self.lora, outs, self.replica)

    def body(self, choices: list[dict], outs: list[RequestOutput]) -> dict:
        return {"id": self.request_id, "object": self.object, "created": self.created,
                "model": self.model, "choices": choices, "usage": usage(outs),
                "loraplex": self.receipt(outs)}

    def chunk(self, choices: list[dict]) -> dict:
        return {"id": self.request_id, "object": self.object, "created": self.created,
                "model": self.model, "choices": choices}


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else dumps(data)}\n\n"


async def merged(streams):
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


async def until_done_or_disconnect(request, coro):
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


async def event_stream(request, info: StreamInfo, streams, states: list[ChoiceState], choice,
                       status_of, write_timeout: float) -> StreamingResponse:
    """The response of a streamed request: streams[i] is prompt i's, its sample j choice
    i * n + j (states[i * n + j] what that choice has sent; n = len(states) //
    len(streams)), chunks interleaved as samples progress.

    The first output is awaited before the response starts, so an error before it (an
    adapter that failed to load) gets its own HTTP status; an error after the first
    chunk is reported as an error event before [DONE]. choice(index, completion, text,
    first_token, first, finished) builds one choice of a chunk."""
    n = len(states) // len(streams)
    outputs = merged(streams)
    try:
        first = await until_done_or_disconnect(request, anext(outputs, None))
    except BaseException:
        for s in streams:
            s.close()
        raise

    async def events():
        finals = []
        try:
            pending = [first] if first is not None else []
            async for i, out in _chain(pending, outputs):
                if out.finished:
                    finals.append(out)
                chunks = []
                for c in out.outputs:
                    delta = states[i * n + c.index].advance(c)
                    if delta is not None:
                        chunks.append(info.chunk([choice(i * n + c.index, c, delta.text, delta.first_token,
                                                         delta.first, c.finish_reason is not None)]))
                if len(finals) == len(streams) and not info.include_usage:  # the last chunk: the receipt
                    chunks = chunks or [info.chunk([])]
                    chunks[-1]["loraplex"] = info.receipt(finals)
                for chunk in chunks:
                    yield _sse(chunk)
            if info.include_usage:
                yield _sse({**info.chunk([]), "usage": usage(finals),
                            "loraplex": info.receipt(finals)})
        except LoraplexError as e:
            code, kind = status_of(e)
            yield _sse(error_body(str(e), kind, code))
        finally:
            for s in streams:
                s.close()
        yield _sse("[DONE]")

    return SSEResponse(events(), write_timeout)


async def _chain(first: list, rest):
    for item in first:
        yield item
    async for item in rest:
        yield item


class SSEResponse(StreamingResponse):
    """An event stream whose client must accept each chunk within `write_timeout`
    seconds (the transport's buffers full means it has stopped reading); if it does
    not, the response ends there and the connection is closed, which aborts its
    requests. The event generator is closed in any case, so its requests never
    outlive the response."""

    def __init__(self, events, write_timeout: float):
        super().__init__(events, media_type="text/event-stream")
        self.write_timeout = write_timeout

    async def stream_response(self, send) -> None:
        async def timed_send(message):
            await asyncio.wait_for(send(message), self.write_timeout)

        try:
            await super().stream_response(timed_send)
        except TimeoutError:
            logger.warning("a client read nothing for %g s: its stream is closed and its requests "
                           "aborted", self.write_timeout)
        finally:
            with anyio.CancelScope(shield=True):  # also when the disconnect cancelled us
                await self.body_iterator.aclose()
