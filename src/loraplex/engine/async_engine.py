"""The engine for asyncio callers: its loop runs in one thread, requests stream back.

Only the engine thread touches the engine. Callers send it commands (add, abort, call)
through a queue; it steps whenever work is pending and hands each RequestOutput to the
caller's asyncio queue with `call_soon_threadsafe`. A caller that stops listening (a
client that disconnected) aborts its request, which frees its pages at the next step.
Shutdown drains: new requests are refused, running ones get `drain_timeout` seconds to
finish, then end with an explicit EngineShutdown error.
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
from loraplex.errors import LoraplexError
from loraplex.types import LoRARequest, RequestOutput, SamplingParams

logger = logging.getLogger("loraplex")


class EngineShutdown(LoraplexError):
    """The server is shutting down: the request was refused or cut short."""


class EngineFailure(LoraplexError):
    """The engine raised while stepping; the requests in it were ended."""


class RequestStream:
    """One request's outputs, in order; close() (or a finished output) ends it, and
    closing it before it finishes aborts the request."""

    def __init__(self, engine: AsyncEngine, request_id: str):
        self.engine, self.request_id = engine, request_id
        self.loop = asyncio.get_running_loop()  # the engine thread delivers into it
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.closed = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self.closed:
            raise StopAsyncIteration
        try:
            item = await self.queue.get()
        except BaseException:  # cancelled: the caller went away
            self.close()
            raise
        if isinstance(item, Exception):
            self.close()
            raise item
        if item.finished:
            self.finished = True
            self.close()
        return item

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.engine._streams.pop(self.request_id, None)
        if not self.finished:
            self.engine._commands.put(("abort", self.request_id))


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._accepting = True
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
    ) -> RequestStream:
        """Queue a request; iterate the returned stream for its (cumulative) outputs.

        Raises the engine's typed errors (InvalidRequest, AdapterError, ...) here, so a
        server can answer with a status code before it starts streaming."""
        if not self._accepting:
            raise EngineShutdown("the server is shutting down")
        stream = RequestStream(self, request_id)
        self._streams[request_id] = stream
        try:
            await self.call(lambda e: e.add_request(request_id, prompt_token_ids, sampling,
                                                    lora_request, prompt))
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
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._streams:
            logger.info("shutdown: ending %d unfinished requests", len(self._streams))
            error = EngineShutdown("the server shut down before this request finished")
            await self.call(self._fail_all(error))
        self._stopped = True
        self._commands.put(("wake",))
        await asyncio.to_thread(self._thread.join, 10)

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
            try:
                self.engine.abort_request(command[1])
            except Exception:
                logger.exception("abort of %s failed", command[1])
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
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _fail_all(self, error: Exception) -> Callable[[LLMEngine], None]:
        def fail(engine: LLMEngine) -> None:
            engine.abort_all()
            for request_id in list(self._streams):
                self._deliver(request_id, error)

        return fail
