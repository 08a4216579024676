"""The OpenAI-compatible front of several engines: one HTTP app that forwards each request
to a replica and relays its answer.

Replicas run the single-engine app (`server/api.py`), so every route, error, stream and
receipt is the one-engine behaviour; the ingress only decides where a request goes and
what the fleet as a whole answers:
- completions and chat go where their adapter is (the `model` field; `routing.py`);
  other single-replica routes (models, unknown paths) go to any replica;
- adapter loads and unloads go to every replica, and are replayed to replicas that
  start later (autoscaling, a restarted one); a load that fails anywhere is undone
  everywhere and its error returned;
- `/metrics` is every replica's, each sample labelled with its replica;
- a replica that fails mid-request fails only that request, explicitly: a 503 in
  OpenAI's error shape before the response started, an error event before `[DONE]`
  after. Requests that arrive later go to the other replicas.

How requests reach replicas is the `Fleet`'s business: Ray Serve handles
(`ray_serve.py`) or HTTP to local processes (`data_parallel.py`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from loraplex.deploy.asgi import Forwarded, Start
from loraplex.server.protocol import error_body
from loraplex.server.streaming import JSON, dumps

logger = logging.getLogger("loraplex")

ROUTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
BROADCAST_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


class ReplicaFailed(Exception):
    """The replica serving a request died or could not be reached."""


class Fleet(Protocol):
    """The replicas behind an ingress."""

    async def replicas(self) -> list[str]:
        """The ids of the replicas serving now."""

    def forward(self, adapter: str | None, request: Forwarded) -> AsyncIterator[Start | bytes]:
        """Route `request` (for `adapter`, None: the base model or no adapter) to a replica
        and yield its response: a Start, then body chunks. Raises ReplicaFailed."""

    def forward_to(self, replica: str, request: Forwarded) -> AsyncIterator[Start | bytes]:
        """The same, to the replica named."""


def adapter_of(body: bytes, base_names: frozenset[str]) -> str | None:
    """The adapter a completion body's `model` names, None for a base model (or a body
    the replica will refuse: it answers with its own 400)."""
    try:
        model = json.loads(body).get("model")
    except (ValueError, AttributeError):
        return None
    return model if isinstance(model, str) and model and model not in base_names else None


async def collect(parts: AsyncIterator[Start | bytes]) -> tuple[int, list[tuple[str, str]], bytes]:
    """A whole response: status, headers, body."""
    start, chunks = None, []
    async for part in parts:
        if isinstance(part, Start):
            start = part
        else:
            chunks.append(part)
    if start is None:
        raise ReplicaFailed("the replica ended the response before it started")
    return start.status, start.headers, b"".join(chunks)


def unavailable(message: str) -> JSON:
    return JSON(error_body(message, "service_unavailable", 503), status_code=503)


class Ingress:
    """The fleet's shared HTTP behaviour (module docstring); `app` is its FastAPI app."""

    def __init__(self, fleet: Fleet, base_names: frozenset[str], max_body_bytes: int = 16 * 2**20):
        self.fleet = fleet
        self.base_names = base_names
        self.max_body_bytes = max_body_bytes
        # Adapters loaded over HTTP, in load order: replayed to replicas that start later.
        self.loaded: dict[str, Forwarded] = {}
        self._synced: set[str] = set()
        self._sync_lock = asyncio.Lock()
        self.app = self._build_app()

    # -- one replica --------------------------------------------------------------------

    async def relay(self, parts: AsyncIterator[Start | bytes]) -> Response:
        """The replica's response as this app's: a 503 if it fails before starting; an
        error event (streams) or a cut body after."""
        try:
            start = await anext(parts)
        except (ReplicaFailed, StopAsyncIteration) as e:
            await parts.aclose()
            return unavailable(f"the replica serving this request failed before answering: {e}")
        assert isinstance(start, Start), "a replica's response starts with its status"
        sse = any(k.lower() == "content-type" and v.startswith("text/event-stream") for k, v in start.headers)

        async def body():
            try:
                async for chunk in parts:
                    yield chunk
            except ReplicaFailed as e:
                logger.warning("a replica failed mid-response: %s", e)
                if not sse:
                    raise
                message = f"the replica serving this request failed mid-stream: {e}"
                yield f"data: {dumps(error_body(message, 'service_unavailable', 503))}\n\n".encode()
                yield b"data: [DONE]\n\n"
            finally:
                await parts.aclose()

        return StreamingResponse(body(), status_code=start.status, headers=dict(start.headers))

    # -- every replica ------------------------------------------------------------------

    async def sync_new_replicas(self) -> None:
        """Replay runtime loads to replicas that have not seen them (started since)."""
        ids = set(await self.fleet.replicas())
        if ids <= self._synced:
            self._synced &= ids
            return
        async with self._sync_lock:
            for replica in sorted(ids - self._synced):
                for name, load in list(self.loaded.items()):
                    try:
                        status, _, body = await collect(self.fleet.forward_to(replica, load))
                    except ReplicaFailed as e:
                        logger.warning("replaying adapter %s to replica %s failed: %s", name, replica, e)
                        continue
                    if status >= 300 and b"already loaded" not in body:
                        logger.warning("replica %s refused adapter %s: %s", replica, name, body[:200])
                self._synced.add(replica)
            self._synced &= ids

    async def broadcast(self, request: Forwarded) -> list[tuple[str, int, list, bytes]]:
        """Every replica's answer. A replica that fails to answer is left out (it has
        died, and one that replaces it is replayed the loads before it serves)."""
        replicas = await self.fleet.replicas()

        async def one(replica):
            try:
                return (replica, *await collect(self.fleet.forward_to(replica, request)))
            except ReplicaFailed as e:
                logger.warning("replica %s did not answer %s: %s", replica, request.path, e)
                self._synced.discard(replica)
                return None

        return [a for a in await asyncio.gather(*(one(r) for r in replicas)) if a is not None]

    async def load_or_unload(self, request: Forwarded) -> Response:
        await self.sync_new_replicas()
        answers = await self.broadcast(request)
        if not answers:
            return unavailable("no replica is serving")
        failed = [a for a in answers if a[1] >= 300]
        name = _lora_name(request.body)
        if request.path == "/v1/load_lora_adapter":
            if failed and name is not None:  # undo it where it loaded: the fleet agrees
                undo = Forwarded("POST", "/v1/unload_lora_adapter", "", request.headers,
                                 json.dumps({"lora_name": name}).encode())
                for replica, status, _, _ in answers:
                    if status < 300:
                        await collect(self.fleet.forward_to(replica, undo))
            elif name is not None:
                self.loaded[name] = request
        elif not failed and name is not None:
            self.loaded.pop(name, None)
        _, status, headers, body = failed[0] if failed else answers[0]
        return Response(body, status_code=status, headers=dict(headers))

    async def metrics(self, request: Forwarded) -> Response:
        answers = await self.broadcast(request)
        if not answers:
            return unavailable("no replica is serving")
        failed = [a for a in answers if a[1] != 200]
        if len(failed) == len(answers):
            _, status, headers, body = failed[0]
            return Response(body, status_code=status, headers=dict(headers))
        text = merge_metrics({r: body.decode() for r, status, _, body in answers if status == 200})
        text += ("# HELP loraplex_replicas replicas serving behind this ingress\n"
                 f"# TYPE loraplex_replicas gauge\nloraplex_replicas {len(answers)}\n")
        return Response(text, media_type="text/plain; version=0.0.4")

    # -- the app ------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="loraplex", version="0.1.0", docs_url=None, redoc_url=None, openapi_url=None)

        @app.get("/health")
        async def health():
            return Response(status_code=200 if await self.fleet.replicas() else 503)

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
        async def forward(request: Request, path: str):
            length = request.headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
                return JSON(error_body(f"the request body exceeds {self.max_body_bytes} bytes", code=413),
                            status_code=413)
            body = await request.body()
            fwd = Forwarded(request.method, request.url.path, request.url.query,
                            [(k, v) for k, v in request.headers.items()], body)
            if fwd.path in BROADCAST_PATHS and fwd.method == "POST":
                return await self.load_or_unload(fwd)
            if fwd.path == "/metrics" and fwd.method == "GET":
                return await self.metrics(fwd)
            await self.sync_new_replicas()
            adapter = adapter_of(body, self.base_names) if fwd.path in ROUTED_PATHS else None
            return await self.relay(self.fleet.forward(adapter, fwd))

        return app


def _lora_name(body: bytes) -> str | None:
    try:
        name = json.loads(body).get("lora_name")
    except (ValueError, AttributeError):
        return None
    return name if isinstance(name, str) else None


def merge_metrics(texts: dict[str, str]) -> str:
    """Prometheus text of several replicas as one exposition: each family once, every
    sample with a `replica` label."""
    families: dict[str, tuple[str, str, list[str]]] = {}
    for replica, text in texts.items():
        for family in text_string_to_metric_families(text):
            _, _, lines = families.setdefault(family.name, (family.documentation, family.type, []))
            for s in family.samples:
                labels = {**s.labels, "replica": replica}
                inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
                lines.append(f"{s.name}{{{inner}}} {_number(s.value)}")
    out = []
    for name, (doc, kind, lines) in families.items():
        name = f"{name}_total" if kind == "counter" else name  # text format 0.0.4 names counters so
        out += [f"# HELP {name} {_escape_help(doc)}", f"# TYPE {name} {kind}", *lines]
    return "\n".join(out) + "\n" if out else ""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _number(value: float) -> str:
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value)) if abs(
        value) < 2**53 else repr(float(value))
