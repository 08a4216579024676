"""Which replica serves a request: adapter affinity weighed against queueing.

One policy for every way loraplex runs on several engines (Ray Serve replicas, data
parallel on one host, the routing simulation), so what the simulation measures is what
serves. A replica is described by its in-flight requests and the adapters it holds in
host memory or a GPU slot ("resident"); the policy ranks replicas by the wait a request
would meet there, in units of one queued request:

    cost(r) = max(0, in_flight(r) - slots)          requests queued past the batch
            + min(in_flight(r), slots) / slots      the batch filling (a full one: 1)
            + miss_cost * (adapter not resident on r)

lowest first. `slots` is a replica's batch (max_num_seqs): requests up to it run at once
and wait for nothing, those past it queue; the filling term spreads requests over the
replicas that hold their adapter before any of them queues. `miss_cost` is what an
adapter load is worth in queued requests (a load from disk takes about as long as a full
replica takes to finish three requests; 2, the default, gave the best p99 TTFT in the
simulation, since a queue that is long now tends to grow). An adapter's requests therefore stay
where it is resident until that replica's queue is `miss_cost` longer than another's;
then they spill to the other, which loads the adapter, so a hot adapter comes to live on
several replicas and one tenant cannot pin one GPU. Equal costs fall to the adapter's
rendezvous-hash order of the replicas (different adapters spread evenly, and one keeps
its order while replicas come and go). Base-model requests go to the least loaded.

`RoundRobin` and `LeastLoaded` are the baselines the simulation compares against
(`benchmarks/replica_routing.py`; RESULTS.md has the figures).
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaLoad:
    """What a router knows of one replica when it routes a request."""

    replica: str  # its id
    in_flight: int  # requests sent to it and not finished
    resident: Collection[str] = ()  # adapter names it holds in host memory or a GPU slot


def rendezvous(key: str, replica: str) -> int:
    """Highest-random-weight hash: replicas sorted by it give each key its own order,
    stable while replicas come and go (only a removed replica's keys move)."""
    return int.from_bytes(hashlib.blake2b(f"{key}\0{replica}".encode(), digest_size=8).digest(), "big")


class AdapterAffinity:
    """The routing policy (see the module docstring): `miss_cost` in queued requests,
    `slots` a replica's batch (0: every in-flight request counts as queued)."""

    name = "affinity"

    def __init__(self, miss_cost: float = 2.0, slots: int = 0, seed: int | None = None):
        if miss_cost < 0 or slots < 0:
            raise ValueError(f"miss_cost and slots must be >= 0, got {miss_cost}, {slots}")
        self.miss_cost = miss_cost
        self.slots = slots
        self._random = random.Random(seed)

    def queued(self, r: ReplicaLoad) -> float:
        """Requests past the batch, plus the batch's filling as a fraction of one."""
        filling = min(r.in_flight, self.slots) / self.slots if self.slots else 0.0
        return max(0, r.in_flight - self.slots) + filling

    def rank(self, adapter: str | None, replicas: Sequence[ReplicaLoad]) -> list[str]:
        """Replica ids, best first. `adapter` None: a base-model request (least loaded,
        ties at random)."""
        if adapter is None:
            salt = str(self._random.random())
            return [r.replica for r in sorted(replicas, key=lambda r: (
                self.queued(r), rendezvous(salt, r.replica)))]

        def cost(r: ReplicaLoad) -> tuple[float, int]:
            miss = 0.0 if adapter in r.resident else self.miss_cost
            return self.queued(r) + miss, -rendezvous(adapter, r.replica)

        return [r.replica for r in sorted(replicas, key=cost)]


class LeastLoaded:
    """Fewest requests in flight, ties at random; adapters ignored."""

    name = "least-loaded"

    def __init__(self, seed: int | None = None):
        self._random = random.Random(seed)

    def rank(self, adapter: str | None, replicas: Sequence[ReplicaLoad]) -> list[str]:
        keyed = [(r.in_flight, self._random.random(), r.replica) for r in replicas]
        return [replica for _, _, replica in sorted(keyed)]


class RoundRobin:
    """Each request to the next replica in turn; load and adapters ignored."""

    name = "round-robin"

    def __init__(self):
        self._turn = itertools.count()

    def rank(self, adapter: str | None, replicas: Sequence[ReplicaLoad]) -> list[str]:
        ids = sorted(r.replica for r in replicas)
        k = next(self._turn) % len(ids) if ids else 0
        return ids[k:] + ids[:k]


class ResidencyLRU:
    """A router's picture of one replica's adapter tier: the last `capacity` adapters it
    sent there, least recently used first out, as the replica's host tier keeps them
    (used where the replica does not report its own, and to see an adapter as resident
    from the moment its first request is sent)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._names: OrderedDict[str, None] = OrderedDict()

    def touch(self, adapter: str) -> None:
        self._names[adapter] = None
        self._names.move_to_end(adapter)
        while len(self._names) > self.capacity:
            self._names.popitem(last=False)

    def __contains__(self, adapter: str) -> bool:
        return adapter in self._names

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)
