"""The engine for asyncio callers: its loop runs in one thread, requests stream back.

Only the engine thread touches the engine. Callers send it commands (add, abort, call)
through a queue; it steps whenever work is pending and hands each RequestOutput to the
caller's RequestStream with `call_soon_threadsafe`. A caller that stops listening (a
client that disconnected) aborts its request, which frees its pages at the next step.
Shutdown drains: new requests are refused, running ones get `drain_timeout` seconds to
finish (or none, once hurried), then end with an explicit EngineShutdown error.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from loraplex.engine.engine import LLMEngine
from loraplex.errors import EngineFailure, LoraplexError
from loraplex.types import LoRARequest, RequestOutput, SamplingParams

logger = logging.getLogger("loraplex")


class EngineShutdown(LoraplexError):
    """The server is shutting down: the request was refused or cut short."""


class RequestStream:
    """One request's outputs, in order; close() (or a finished output) ends it, and
    closing it before it finishes aborts the request.

    Outputs are cumulative (text, tokens and logprobs so far), so a reader that falls
    behind skips to the newest: at most one output waits here however slowly it reads
    (a client that stops reading holds one output, not one per step). `on_end` hears
    once how the stream ended: "ok", "error" or "aborted", with the newest output."""

    def __init__(self, engine: AsyncEngine, request_id: str,
                 on_end: Callable[[str, RequestOutput | None], None] | None = None):
        self.engine, self.request_id = engine, request_id
        self.loop = asyncio.get_running_loop()  # the engine thread delivers into it
        self.on_end = on_end
        self.last: RequestOutput | None = None  # the newest output read
        self._latest: RequestOutput | None = None  # delivered, not read yet
        self._error: Exception | None = None
        self._ready = asyncio.Event()
        self.finished = False
        self.closed = False
        self._ended = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self.closed:
            raise StopAsyncIteration
        try:
            await self._ready.wait()
        except BaseException:  # cancelled: the caller went away
            self.close()
            raise
        self._ready.clear()
        if self._error is not None:
            self._end("error", self._latest or self.last)
            self.close()
            raise self._error
        item, self._latest = self._latest, None
        self.last = item
        if item.finished:
            self.finished = True
            self._end("ok", item)
            self.close()
        return item

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.engine._streams.pop(self.request_id, None)
        if not self.finished and not self._ended:
            self.engine._commands.put(("abort", self))

    def _put(self, item: RequestOutput | Exception) -> None:
        """On the event loop: the engine thread's newest output, or the error that ended
        the request."""
        if isinstance(item, Exception):
            self._error = item
        else:
            self._latest = item
        self._ready.set()

    def _end(self, outcome: str, out: RequestOutput | None) -> None:
        if not self._ended:
            self._ended = True
            if self.on_end is not None:
                self.on_end(outcome, out)


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._accepting = True
        self._hurry = False
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="loraplex-engine", daemon=True)
        self._thread.start()

    # -- caller side (any thread with an event loop) ------------------------------------

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        lora_request: LoRARequest | None = None,
        prompt: str | None = None,
        cache_salt: str = "",
        on_end: Callable[[str, RequestOutput | None], None] | None = None,
    ) -> RequestStream:
        """Queue a request; iterate the returned stream for its (cumulative) outputs.

        Raises the engine's typed errors (InvalidRequest, AdapterError, ...) here, so a
        server can answer with a status code before it starts streaming. `on_end`: see
        RequestStream."""
        if not self._accepting:
            raise EngineShutdown("the server is shutting down")
        if sampling.structured_outputs is not None:  # a spec that does not compile is a 400
            spec = sampling.structured_outputs
            await asyncio.wrap_future(await self.call(lambda e: e.compile_grammar(spec)))
        stream = RequestStream(self, request_id, on_end)
        self._streams[request_id] = stream
        try:
            await self.call(lambda e: e.add_request(request_id, prompt_token_ids, sampling,
                                                    lora_request, prompt, cache_salt))
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return stream

    async def call(self, fn: Callable[[LLMEngine], object]):
        """Run fn(engine) on the engine thread and return its result (or raise)."""
        future: Future = Future()
        self._commands.put(("call", fn, future))
        return await asyncio.wrap_future(future)

    async def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Refuse new requests, let running ones finish, end the rest with an error."""
        if self._stopped:
            return
        self._accepting = False
        deadline = time.monotonic() + drain_timeout
        while self._streams and time.monotonic() < deadline and not self._hurry:
            await asyncio.sleep(0.05)
        if self._streams:
            logger.info("shutdown: ending %d unfinished requests", len(self._streams))
            error = EngineShutdown("the server shut down before this request finished")
            await self.call(self._fail_all(error))
        self._stopped = True
        self._commands.put(("wake",))
        await asyncio.to_thread(self._thread.join, 10)
        self.engine.close()

    def hurry(self) -> None:
        """End a drain now (a second signal): unfinished requests get their error at once."""
        self._accepting = False
        self._hurry = True

    # -- engine thread ------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopped:
            if self.engine.has_unfinished_requests():
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            else:
                command = self._commands.get()  # idle: sleep until told something
            if command is not None:
                self._run(command)
                continue  # drain every queued command before stepping
            try:
                outputs = self.engine.step()
            except Exception as e:  # keep serving: fail what was in flight, log why
                logger.exception("engine step failed")
                self._fail_all(EngineFailure(f"engine step failed: {e}"))(self.engine)
                continue
            for out in outputs:
                self._deliver(out.request_id, out)

    def _run(self, command) -> None:
        kind = command[0]
        if kind == "abort":
            stream = command[1]
            out = None
            try:
                out = self.engine.abort_request(stream.request_id)
            except Exception:
                logger.exception("abort of %s failed", stream.request_id)
            stream.loop.call_soon_threadsafe(stream._end, "aborted", out or stream._latest or stream.last)
        elif kind == "call":
            _, fn, future = command
            try:
                future.set_result(fn(self.engine))
            except Exception as e:
                future.set_exception(e)

    def _deliver(self, request_id: str, item) -> None:
        if isinstance(item, RequestOutput) and item.error is not None:
            item = item.error  # e.g. its adapter failed to load: the stream raises it
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream._put, item)

    def _fail_all(self, error: Exception) -> Callable[[LLMEngine], None]:
        def fail(engine: LLMEngine) -> None:
            engine.abort_all()
            for request_id in list(self._streams):
                self._deliver(request_id, error)

        return fail
