"""loraplex on Ray Serve: engine replicas multiplexed by adapter, behind one ingress.

- `EngineReplica` (a deployment, one per GPU or a fraction of one) builds the engine
  and the single-engine HTTP app exactly as `loraplex serve` does, and answers the
  ingress's forwarded requests through it (`asgi.call_asgi`). Each request's adapter is
  its Serve multiplexed model id: the replica reports the adapters it holds (Serve's
  multiplexing, with the host tier's size, `max_cpu_loras`, as its model budget), and
  its receipts name the replica.
- `AffinityRequestRouter` is Serve's request router for the replicas: it ranks them
  with `routing.AdapterAffinity` from what Serve reports (multiplexed ids, queue
  lengths) and what it sent itself (an adapter counts as resident from its first
  request there, before the replica's report arrives). A call that names a `replica`
  goes there: that is how the ingress reaches every replica (loads, unloads, metrics).
- `IngressDeployment` wraps `ingress.Ingress` over a `ServeFleet`, the handle to the
  replicas.

`application(args)` builds the application from `loraplex serve`'s arguments;
`loraplex serve --replicas N` starts a local Ray instance and runs it, and
`serve run loraplex.deploy:app args="MODEL --replicas 2 ..."` runs it on a cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shlex
from collections import defaultdict
from collections.abc import AsyncIterator

from ray import serve
from ray.exceptions import RayError
from ray.serve.request_router import (
    FIFOMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from loraplex.deploy.args import host_adapters, serve_parser
from loraplex.deploy.asgi import Forwarded, Start, call_asgi
from loraplex.deploy.ingress import Ingress, ReplicaFailed
from loraplex.deploy.routing import AdapterAffinity, ReplicaLoad, ResidencyLRU

logger = logging.getLogger("loraplex")

ENGINE_DEPLOYMENT = "EngineReplica"
PINNED_TIMEOUT_S = 60.0  # a load, unload or metrics call to one replica


def routers() -> dict[str, AffinityRequestRouter]:
    """The routers in this process (the ingress's handle makes one), by deployment name.
    Reached through the imported module: Serve may run a by-value copy of this code
    (its ingress wrapper class is pickled whole), whose globals are its own."""
    import loraplex.deploy.ray_serve as module

    return module.__dict__.setdefault("_routers", {})


def parse_serve_argv(argv: list[str]) -> argparse.Namespace:
    """A `loraplex serve` command line (without the word serve) -> its arguments."""
    args = serve_parser().parse_args(argv)
    if args.model is None:
        raise SystemExit("name the model directory: a deployment on a cluster has no default model")
    return args


class AffinityRequestRouter(FIFOMixin, MultiplexMixin, RequestRouter):
    def initialize_state(self, miss_cost: float = 2.0, slots: int = 0, resident_capacity: int = 32):
        self.policy = AdapterAffinity(miss_cost, slots)
        self._sent: dict[ReplicaID, ResidencyLRU] = defaultdict(lambda: ResidencyLRU(resident_capacity))
        routers()[self._deployment_id.name] = self

    def replica_ids(self) -> list[str]:
        return [rid.unique_id for rid in self.curr_replicas]

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        pinned = pending_request.kwargs.get("replica") if pending_request is not None else None
        if pinned is not None:
            return [[by_id[pinned]]] if pinned in by_id else []
        adapter = (pending_request.metadata.multiplexed_model_id or None) if pending_request else None
        cache = self.replica_queue_len_cache
        loads = [ReplicaLoad(rid, cache.get(r.replica_id) or 0,
                             set(r.multiplexed_model_ids) | set(self._sent[r.replica_id]))
                 for rid, r in by_id.items()]
        return [[by_id[rid]] for rid in self.policy.rank(adapter, loads)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        adapter = pending_request.metadata.multiplexed_model_id if pending_request else ""
        if adapter:
            self._sent[replica_id].touch(adapter)

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self._sent.pop(replica_id, None)


class ServeFleet:
    """The engine replicas through a Serve deployment handle."""

    def __init__(self, handle):
        self.handle = handle.options(stream=True)
        self._warm = False

    async def replicas(self) -> list[str]:
        if not self._warm:  # the handle's router starts with its first request
            await _drain(self.handle.http.remote(Forwarded("GET", "/health")))
            self._warm = True
        router = routers().get(self.handle.deployment_name)
        return router.replica_ids() if router is not None else []

    async def forward(self, adapter: str | None, request: Forwarded) -> AsyncIterator[Start | bytes]:
        routed = self.handle.options(multiplexed_model_id=adapter or "")
        async for part in _parts(routed.http.remote(request)):
            yield part

    async def forward_to(self, replica: str, request: Forwarded) -> AsyncIterator[Start | bytes]:
        if replica not in await self.replicas():  # Serve would retry a pinned call for ever
            raise ReplicaFailed(f"replica {replica} is not serving")
        async for part in _parts(self.handle.http.remote(request, replica=replica), PINNED_TIMEOUT_S):
            yield part


async def _parts(response, first_within: float | None = None) -> AsyncIterator[Start | bytes]:
    """The response's parts; ReplicaFailed if its replica dies, or sends nothing for
    `first_within` seconds (a pinned call to a replica that has just left)."""
    try:
        parts = aiter(response)
        try:
            yield await asyncio.wait_for(anext(parts), first_within)
        except (StopAsyncIteration, TimeoutError):
            raise ReplicaFailed("the replica did not answer") from None
        async for part in parts:
            yield part
    except RayError as e:  # the replica died (or Serve could not reach it)
        raise ReplicaFailed(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    finally:
        response.cancel()


async def _drain(response) -> None:
    async for _ in _parts(response):
        pass


def engine_replica_class(max_models: int):
    """The replica deployment's class; Serve's multiplexing budget is fixed when the
    class is made, so it is made per application."""

    class EngineReplica:
        def __init__(self, args: argparse.Namespace):
            from loraplex.server.run import build_server

            self.server, self.app = build_server(args)
            context = serve.get_replica_context()
            self.server.replica_name = context.replica_id.unique_id if context else None
            logger.info("replica %s serving", self.server.replica_name)

        @serve.multiplexed(max_num_models_per_replica=max_models)
        async def resident(self, adapter: str) -> str:
            """Serve's record that this replica holds `adapter`: the engine loads it
            with the request's first step (the host tier keeps the last
            max_cpu_loras, as Serve's record does)."""
            return adapter

        async def http(self, request: Forwarded, replica: str | None = None) -> AsyncIterator[Start | bytes]:
            adapter = serve.get_multiplexed_model_id()
            served = self.server.served
            if adapter and (adapter in served.adapters or served.registry is not None):
                await self.resident(adapter)
            async for part in call_asgi(self.app, request):
                yield part

        async def check_health(self) -> None:
            if not self.server.engine._thread.is_alive():
                raise RuntimeError("the engine thread has stopped")

        async def __del__(self):
            await self.server.engine.shutdown(0)

    return EngineReplica


@serve.ingress()
class IngressDeployment:
    def __init__(self, engines, base_names: list[str], max_body_bytes: int):
        self.ingress = Ingress(ServeFleet(engines), frozenset(base_names), max_body_bytes)

    def __serve_build_asgi_app__(self):
        return self.ingress.app


def application(args: argparse.Namespace):
    """The Serve application of `loraplex serve`'s arguments (--replicas,
    --gpus-per-replica and the autoscaling flags shape the deployments; every other flag
    goes to each replica's engine and server)."""
    max_models = host_adapters(args)
    replica = serve.deployment(
        engine_replica_class(max_models), name=ENGINE_DEPLOYMENT,
        ray_actor_options={"num_gpus": _gpus_per_replica(args), "num_cpus": args.cpus_per_replica},
        max_ongoing_requests=args.max_ongoing_requests,
        health_check_period_s=2.0, health_check_timeout_s=30.0,
        request_router_config={"request_router_class": f"{__name__}.AffinityRequestRouter",
                               "request_router_kwargs": {"miss_cost": args.route_miss_cost,
                                                         "slots": args.max_num_seqs,
                                                         "resident_capacity": max_models}},
        **_scaling(args))
    ingress = serve.deployment(IngressDeployment, name="Ingress", ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=100_000)
    base_names = args.served_model_name or [args.model]
    return ingress.bind(replica.bind(args), base_names, args.max_request_bytes)


def _gpus_per_replica(args) -> float:
    if args.gpus_per_replica is not None:
        return args.gpus_per_replica
    import ray

    gpus = ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0
    return float(args.tensor_parallel_size) if gpus else 0.0  # a replica's ranks, a GPU each


def _scaling(args) -> dict:
    if args.max_replicas is None:
        return {"num_replicas": args.replicas}
    if args.max_replicas < args.replicas:
        raise SystemExit("--max-replicas must be at least --replicas")
    return {"autoscaling_config": {"min_replicas": args.replicas, "max_replicas": args.max_replicas,
                                   "target_ongoing_requests": args.target_ongoing_requests}}


def app(builder_args: dict):
    """`serve run loraplex.deploy:app args="MODEL --replicas 2 ..."` (or a Serve YAML's
    `args: {args: ...}`): the application of that `loraplex serve` command line."""
    return application(parse_serve_argv(shlex.split(builder_args.get("args", ""))))


def run(args: argparse.Namespace) -> int:
    """`loraplex serve --replicas N`: Ray (local unless --ray-address), Serve's HTTP proxy
    on --host/--port, the application; until a signal, then Serve shuts down (replicas
    drain their engines)."""
    import signal
    import threading

    import ray

    if not ray.is_initialized():
        ray.init(address=args.ray_address, include_dashboard=False, logging_level=logging.WARNING)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(application(args), name="loraplex", route_prefix="/")
    logger.info("serving %s through Ray Serve on http://%s:%d (%d replicas)",
                ", ".join(args.served_model_name or [args.model]), args.host, args.port, args.replicas)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    return 0
