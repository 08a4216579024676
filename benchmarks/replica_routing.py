"""Routing across replicas, simulated: loraplex's router (`loraplex.deploy.routing`) over
simulated engines, against round-robin and plain least-loaded routing.

Each simulated replica is a continuous-batching engine with the service times measured
on one H200 for Llama-3.1-8B with rank-16 adapters (RESULTS.md, "Llama-3.1-8B, 32
adapters" and "Adapter loads"): up to `--batch` sequences run at once; a step decodes one
token for each, taking `decode_base_ms + decode_per_seq_ms * sequences`, plus
`prefill_ms_per_token` for each prompt token admitted in it; a request needs its adapter
in the replica's host tier (the last `--host-adapters` used, least recently used out),
and one that is not there waits `--load-ms` for it (loads run beside the steps, never
blocking them). Requests arrive as a Poisson stream at `--load` of the fleet's capacity,
their adapters drawn from Zipf(`--zipf`) over `--adapters`. Each policy routes with the
replicas' in-flight counts and host tiers, the same view the Ray Serve router has.

Reported per policy: adapter hit rate (the adapter was in the chosen replica's host tier
when the request arrived), queueing delay (arrival to admission) and TTFT, median and
p99. Writes the figure of RESULTS.md "Replica routing (simulated)".

    python -m benchmarks.replica_routing --replicas 8 --adapters 1000 --zipf 1.0
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from benchmarks import harness


@dataclass
class Request:
    arrival: float
    adapter: str
    prompt_tokens: int
    output_tokens: int
    ready: float = 0.0  # when its adapter is in the host tier
    admitted: float | None = None
    first_token: float | None = None
    left: int = 0
    hit: bool = False


@dataclass
class Replica:
    name: str
    host_adapters: int
    running: list = field(default_factory=list)
    waiting: deque = field(default_factory=deque)
    host: OrderedDict = field(default_factory=OrderedDict)  # adapter -> time it is loaded by
    busy_until: float = 0.0  # the step in flight ends then (0: idle)
    step: int = 0  # the step in flight's number

    @property
    def in_flight(self) -> int:
        return len(self.running) + len(self.waiting)

    def take(self, request: Request, now: float, load_s: float) -> None:
        """Queue the request; start its adapter's load if the host tier lacks it."""
        loaded = self.host.get(request.adapter)
        request.hit = loaded is not None and loaded <= now
        if loaded is None:
            loaded = now + load_s
        self.host[request.adapter] = loaded
        self.host.move_to_end(request.adapter)
        while len(self.host) > self.host_adapters:
            self.host.popitem(last=False)
        request.ready = loaded
        self.waiting.append(request)


def simulate(policy, args, seed: int) -> dict:
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** args.zipf for k in range(args.adapters)]
    names = [f"ad-{k}" for k in range(args.adapters)]
    step_s = lambda n, prompt: (args.decode_base_ms + args.decode_per_seq_ms * n  # noqa: E731
                                + args.prefill_ms_per_token * prompt) / 1e3
    # A full replica finishes mu requests a second: its decode steps (each a token for
    # `batch` sequences) and prompt tokens fill the second.
    mu = 1.0 / (step_s(args.batch, 0) * args.output_tokens / args.batch
                + args.prefill_ms_per_token * args.prompt_tokens / 1e3)
    rate = args.load * args.replicas * mu  # requests/s at --load of the fleet's capacity
    replicas = [Replica(f"r{i}", args.host_adapters) for i in range(args.replicas)]
    by_name = {r.name: r for r in replicas}
    total = (args.warmup_per_replica + args.requests_per_replica) * args.replicas
    events = []  # (time, order, kind, replica name or request)
    order = 0
    t = 0.0
    for _ in range(total):
        t += rng.expovariate(rate)
        adapter = rng.choices(names, weights)[0]
        request = Request(t, adapter, args.prompt_tokens, args.output_tokens)
        heapq.heappush(events, (t, order, "arrive", request))
        order += 1
    done = []

    def start_step(r: Replica, now: float) -> None:
        nonlocal order
        prompt = 0
        admissible = [q for q in r.waiting if q.ready <= now]
        for q in admissible[: max(args.batch - len(r.running), 0)]:
            r.waiting.remove(q)
            q.admitted, q.left = now, q.output_tokens
            prompt += q.prompt_tokens
            r.running.append(q)
        if not r.running:
            r.busy_until = 0.0
            pending = [q.ready for q in r.waiting]
            if pending:  # idle until the first adapter load ends
                heapq.heappush(events, (min(pending), order, "wake", r.name))
                order += 1
            return
        r.busy_until = now + step_s(len(r.running), prompt)
        r.step += 1
        heapq.heappush(events, (r.busy_until, order, "step", (r.name, r.step)))
        order += 1

    while events:
        now, _, kind, what = heapq.heappop(events)
        if kind == "arrive":
            loads = [router_view(r) for r in replicas]
            r = by_name[policy.rank(what.adapter, loads)[0]]
            r.take(what, now, args.load_ms / 1e3)
            if r.busy_until == 0.0:
                start_step(r, now)
            continue
        if kind == "wake":
            r = by_name[what]
            if r.busy_until == 0.0:  # (else a step started since: it admits the request)
                start_step(r, now)
            continue
        r = by_name[what[0]]
        assert what[1] == r.step, "one step in flight a replica"
        for q in list(r.running):
            if q.first_token is None:
                q.first_token = now
            q.left -= 1
            if q.left <= 0:
                r.running.remove(q)
                done.append(q)
        start_step(r, now)

    done.sort(key=lambda q: q.arrival)
    done = done[args.warmup_per_replica * args.replicas:]  # measured once the host tiers have filled
    queue_ms = [(q.admitted - q.arrival) * 1e3 for q in done]
    ttft_ms = [(q.first_token - q.arrival) * 1e3 for q in done]
    span = max(q.first_token for q in done) - min(q.arrival for q in done)
    return {"policy": policy.name, "requests": len(done), "arrival_rate": round(rate, 1),
            "hit_rate": sum(q.hit for q in done) / len(done),
            "queue_ms_p50": statistics.median(queue_ms), "queue_ms_p99": _p99(queue_ms),
            "ttft_ms_p50": statistics.median(ttft_ms), "ttft_ms_p99": _p99(ttft_ms),
            "requests_per_s": len(done) / span}


def router_view(r: Replica):
    """What the router sees: in-flight requests, and the adapters held or loading (as
    Serve's multiplexed ids count them)."""
    from loraplex.deploy.routing import ReplicaLoad

    return ReplicaLoad(r.name, r.in_flight, r.host.keys())


def _p99(values: list[float]) -> float:
    return sorted(values)[min(len(values) - 1, int(0.99 * len(values)))]


def main(argv=None) -> int:
    p = harness.parser(__doc__)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--adapters", type=int, default=1000)
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--requests-per-replica", type=int, default=1500, help="measured")
    p.add_argument("--warmup-per-replica", type=int, default=4000,
                   help="requests before the measured ones (the host tiers fill)")
    p.add_argument("--load", type=float, nargs="+", default=[0.6, 0.8, 0.9],
                   help="arrival rate as a fraction of the fleet's capacity (full batches)")
    p.add_argument("--batch", type=int, default=32, help="sequences a replica runs at once")
    p.add_argument("--host-adapters", type=int, default=192,
                   help="a replica's host tier (max_cpu_loras; 192 of 84 MB fill a 16 GiB budget)")
    p.add_argument("--load-ms", type=float, default=110.0, help="an adapter load from the disk cache")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--decode-base-ms", type=float, default=3.0)
    p.add_argument("--decode-per-seq-ms", type=float, default=0.106,
                   help="with --decode-base-ms: 6.4 ms a step at 32 sequences (H200, 32 adapters)")
    p.add_argument("--prefill-ms-per-token", type=float, default=0.0193,
                   help="39.1 ms for a 2,048-token step beyond its decode (H200)")
    p.add_argument("--miss-cost", type=float, nargs="+", default=[2.0])
    p.add_argument("--seeds", type=int, default=3)
    args = p.parse_args(argv)
    from loraplex.deploy.routing import AdapterAffinity, LeastLoaded, RoundRobin

    results = []
    for load in args.load:
        args_at = argparse.Namespace(**{**vars(args), "load": load})
        policies = [lambda: RoundRobin(), lambda: LeastLoaded(seed=0)]
        policies += [lambda c=c: _named(AdapterAffinity(c, args.batch, seed=0),
                                                f"affinity (miss cost {c:g})")
                     for c in args.miss_cost]
        for make in policies:
            runs = [simulate(make(), args_at, seed) for seed in range(args.seeds)]
            row = {"load": load, "policy": runs[0]["policy"], "requests": sum(r["requests"] for r in runs)}
            for key in ("hit_rate", "queue_ms_p50", "queue_ms_p99", "ttft_ms_p50", "ttft_ms_p99",
                        "requests_per_s", "arrival_rate"):
                row[key] = statistics.median(r[key] for r in runs)
            results.append(row)
            print(f"load {load:.2f} {row['policy']:<24} hit {row['hit_rate']:6.1%}  queue p50/p99 "
                  f"{row['queue_ms_p50']:7.1f} / {row['queue_ms_p99']:7.1f} ms  TTFT p50/p99 "
                  f"{row['ttft_ms_p50']:7.1f} / {row['ttft_ms_p99']:7.1f} ms  "
                  f"{row['requests_per_s']:.0f} req/s "
                  f"({row['requests']} requests)", flush=True)
    harness.write_json(args.out, results, args)
    return 0


def _named(policy, name: str):
    policy.name = name
    return policy


if __name__ == "__main__":
    raise SystemExit(main())
