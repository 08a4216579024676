"""`loraplex serve`'s flags for several engines: Ray Serve replicas or data parallel."""

from __future__ import annotations

import argparse

from loraplex.config import LoRAConfig
from loraplex.engine.args import at_least

GROUP = "several engines (Ray Serve replicas, or data parallel on one host)"


def _positive_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(GROUP)
    g.add_argument("--replicas", type=at_least(1), default=None,
                   help="serve through Ray Serve with this many engine replicas, routed by adapter "
                        "(starts a local Ray instance unless --ray-address names a cluster)")
    g.add_argument("--gpus-per-replica", type=_positive_float, default=None,
                   help="GPUs each replica reserves (a fraction shares one; default: "
                        "--tensor-parallel-size where Ray sees GPUs, else 0)")
    g.add_argument("--cpus-per-replica", type=_positive_float, default=1.0,
                   help="CPUs each replica reserves in Ray")
    g.add_argument("--max-replicas", type=at_least(1), default=None,
                   help="autoscale between --replicas and this many on queue length")
    g.add_argument("--target-ongoing-requests", type=at_least(1), default=32,
                   help="requests in flight per replica the autoscaler aims for")
    g.add_argument("--max-ongoing-requests", type=at_least(1), default=1024,
                   help="requests a replica accepts at once (the engine queues past its batch)")
    g.add_argument("--route-miss-cost", type=_positive_float, default=2.0,
                   help="what an adapter load is worth in queued requests: a replica holding a "
                        "request's adapter may queue this many more than another before the request "
                        "goes to the other, which loads it")
    g.add_argument("--ray-address", default=None,
                   help="an existing Ray cluster to run on (ray.init's address; e.g. auto)")
    g.add_argument("--data-parallel-size", type=at_least(1), default=None,
                   help="this many engine processes on this host, one per GPU, behind one "
                        "adapter-affine router (no Ray)")


def host_adapters(args: argparse.Namespace) -> int:
    """A replica's host tier, in adapters, as its engine will size it: the router's
    picture of what it holds is that long."""
    return LoRAConfig(max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras).host_capacity


def serve_parser() -> argparse.ArgumentParser:
    """`loraplex serve`'s parser (without the word serve): the server's, the engine's and
    these flags."""
    from loraplex.server import run as serve

    p = argparse.ArgumentParser(prog="loraplex serve")
    add_arguments(p)
    serve.add_arguments(p)
    return p
