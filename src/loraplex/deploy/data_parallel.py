"""`loraplex serve --data-parallel-size N`: N engines on one host without Ray.

Each engine is a `loraplex serve` process of its own (one GPU each, or
--tensor-parallel-size GPUs: CUDA_VISIBLE_DEVICES is set before it touches CUDA) on a
loopback port; this process runs the ingress (`ingress.py`) over an `HttpFleet`, which
routes with the same policy as the Ray Serve router (`routing.AdapterAffinity`). Nothing
reports residency here, so the fleet keeps each engine's picture itself: the last
`max_cpu_loras` adapters it sent there (the engine's host tier keeps as many, least
recently used out). An engine process that dies fails its own requests and leaves the
rotation; the others keep serving.
"""

from __future__ import annotations

import argparse
import copy
import logging
import multiprocessing
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable

import httpx

from loraplex.deploy.args import host_adapters
from loraplex.deploy.asgi import Forwarded, Start, relay_headers
from loraplex.deploy.ingress import Ingress, ReplicaFailed
from loraplex.deploy.routing import AdapterAffinity, ReplicaLoad, ResidencyLRU

logger = logging.getLogger("loraplex")


class HttpFleet:
    """Engines behind HTTP base URLs, routed by `policy`."""

    def __init__(self, urls: dict[str, str], policy, resident_capacity: int,
                 alive: Callable[[str], bool] = lambda replica: True):
        self.urls = urls
        self.policy = policy
        self.alive = alive
        self.in_flight: Counter[str] = Counter()
        self.resident = {r: ResidencyLRU(resident_capacity) for r in urls}
        self._clients = {r: httpx.AsyncClient(base_url=url, timeout=None) for r, url in urls.items()}

    async def replicas(self) -> list[str]:
        return [r for r in self.urls if self.alive(r)]

    async def forward(self, adapter: str | None, request: Forwarded) -> AsyncIterator[Start | bytes]:
        live = await self.replicas()
        if not live:
            raise ReplicaFailed("no replica is serving")
        loads = [ReplicaLoad(r, self.in_flight[r], self.resident[r]) for r in live]
        replica = self.policy.rank(adapter, loads)[0]
        if adapter is not None:
            self.resident[replica].touch(adapter)
        async for part in self.forward_to(replica, request):
            yield part

    async def forward_to(self, replica: str, request: Forwarded) -> AsyncIterator[Start | bytes]:
        client = self._clients[replica]
        self.in_flight[replica] += 1
        response = None
        try:
            built = client.build_request(request.method, request.path, params=request.query or None,
                                         headers=relay_headers(request.headers), content=request.body)
            response = await client.send(built, stream=True)
            yield Start(response.status_code, relay_headers(response.headers.items()))
            async for chunk in response.aiter_raw():
                yield chunk
        except httpx.TransportError as e:
            raise ReplicaFailed(f"replica {replica}: {type(e).__name__}: {e}") from None
        finally:
            self.in_flight[replica] -= 1
            if response is not None:
                await response.aclose()

    async def close(self) -> None:
        for client in self._clients.values():
            await client.aclose()


def _engine_process(args: argparse.Namespace, name: str, gpu: int | None, ports) -> None:
    """A child: one `loraplex serve` on a loopback port it reports back."""
    args.replica_name = name  # in its receipts
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    from loraplex.server import run as serve

    sock = serve.bind("127.0.0.1", 0)
    ports.put(sock.getsockname()[1])
    serve.main(args, sock)


def start_engines(args: argparse.Namespace, gpus: int) -> tuple[list, dict[str, str]]:
    """N engine processes (GPUs i*tp .. (i+1)*tp - 1 for process i where there are GPUs,
    tp its tensor-parallel size), each ready."""
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: CUDA untouched
    child_args = copy.copy(args)
    child_args.data_parallel_size = None
    processes, urls = [], {}
    for i in range(args.data_parallel_size):
        ports = context.Queue()
        name = f"engine-{i}"
        tp = args.tensor_parallel_size
        devices = ",".join(str(g) for g in range(i * tp, (i + 1) * tp)) if gpus else None
        p = context.Process(target=_engine_process, name=f"loraplex-{name}", daemon=False,
                            args=(child_args, name, devices, ports))
        p.start()
        processes.append(p)
        urls[name] = f"http://127.0.0.1:{ports.get(timeout=600)}"
    for url, p in zip(urls.values(), processes):
        _wait_ready(url, p)
    return processes, urls


def _wait_ready(url: str, process, timeout: float = 1800.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process.is_alive():
            raise SystemExit(f"engine process {process.name} exited ({process.exitcode}) while starting")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"engine process {process.name} did not start in {timeout:.0f} s")


def run(args: argparse.Namespace, sock) -> int:
    """Start the engines, serve the ingress on `sock` until a signal, then stop them
    (each drains as `loraplex serve` does on SIGTERM)."""
    import torch
    import uvicorn

    gpus = torch.cuda.device_count()
    need = args.data_parallel_size * args.tensor_parallel_size
    if gpus and need > gpus:
        raise SystemExit(f"--data-parallel-size {args.data_parallel_size} x --tensor-parallel-size "
                         f"{args.tensor_parallel_size} needs {need} GPUs; {gpus} are visible")
    processes, urls = start_engines(args, gpus)
    alive = dict(zip(urls, processes))
    fleet = HttpFleet(urls, AdapterAffinity(args.route_miss_cost, args.max_num_seqs),
                      host_adapters(args), lambda r: alive[r].is_alive())
    ingress = Ingress(fleet, frozenset(args.served_model_name or [args.model]), args.max_request_bytes)
    logger.info("serving on http://%s:%d through %d engines", args.host, args.port, len(processes))
    try:
        uvicorn.Server(uvicorn.Config(ingress.app, log_level="info")).run(sockets=[sock])
    finally:
        for p in processes:
            p.terminate()  # SIGTERM: each drains its running requests
        for p in processes:
            p.join(args.shutdown_timeout + 10)
    return 0
