"""Several engines behind one ingress: the routing policy, and two replicas of the tiny
model through Ray Serve (a local Ray instance) and through data parallel processes,
each against one engine serving the same arguments."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest
from conftest import tolerance
from prometheus_client.parser import text_string_to_metric_families
from serving import ACME, ADMIN, GLOBEX, free_port, running, tenant_serve_args

from loraplex.deploy.asgi import Forwarded
from loraplex.deploy.ingress import adapter_of, collect, merge_metrics
from loraplex.deploy.routing import AdapterAffinity, LeastLoaded, ReplicaLoad, ResidencyLRU, RoundRobin

# -- the policy ---------------------------------------------------------------------------


def test_an_adapter_stays_where_it_is_resident_until_that_replica_is_miss_cost_busier():
    policy = AdapterAffinity(miss_cost=4)
    loads = [ReplicaLoad("r0", 3, {"a"}), ReplicaLoad("r1", 0), ReplicaLoad("r2", 1)]
    assert policy.rank("a", loads)[0] == "r0"  # 3 + 0 < 0 + 4
    busier = [ReplicaLoad("r0", 5, {"a"}), ReplicaLoad("r1", 0), ReplicaLoad("r2", 1)]
    assert policy.rank("a", busier)[0] == "r1"  # a hot adapter gets a second home
    both = [ReplicaLoad("r0", 5, {"a"}), ReplicaLoad("r1", 2, {"a"}), ReplicaLoad("r2", 0)]
    assert policy.rank("a", both)[0] == "r1"
    assert policy.rank(None, busier)[0] == "r1"  # the base model: load alone


def test_below_their_batch_replicas_holding_the_adapter_share_its_requests():
    policy = AdapterAffinity(miss_cost=4, slots=8)
    loads = [ReplicaLoad("r0", 6, {"a"}), ReplicaLoad("r1", 2, {"a"}), ReplicaLoad("r2", 0)]
    assert policy.rank("a", loads)[:2] == ["r1", "r0"]  # neither queues: the emptier first
    full = [ReplicaLoad("r0", 11, {"a"}), ReplicaLoad("r1", 0)]
    assert policy.rank("a", full)[0] == "r0"  # 3 queued + 1 < a load (4) + 0
    fuller = [ReplicaLoad("r0", 13, {"a"}), ReplicaLoad("r1", 0)]
    assert policy.rank("a", fuller)[0] == "r1"  # 5 queued + 1 > 4: the load is cheaper


def test_cold_adapters_spread_evenly_and_always_try_the_same_replica_first():
    policy = AdapterAffinity()
    idle = [ReplicaLoad(f"r{i}", 0) for i in range(8)]
    firsts = {f"ad-{k}": policy.rank(f"ad-{k}", idle)[0] for k in range(4000)}
    assert all(policy.rank(a, list(reversed(idle)))[0] == r for a, r in list(firsts.items())[:50])
    counts = Counter(firsts.values())
    assert len(counts) == 8 and max(counts.values()) < 1.15 * 500 and min(counts.values()) > 0.85 * 500
    # A replica leaving moves only its own adapters.
    without = [r for r in idle if r.replica != "r3"]
    moved = [a for a, r in firsts.items() if r != "r3" and policy.rank(a, without)[0] != r]
    assert moved == []


def test_baselines_and_the_residency_lru():
    rr = RoundRobin()
    loads = [ReplicaLoad("b", 9), ReplicaLoad("a", 0)]
    assert [rr.rank("x", loads)[0] for _ in range(4)] == ["a", "b", "a", "b"]
    assert LeastLoaded(seed=0).rank("x", loads)[0] == "a"
    lru = ResidencyLRU(2)
    for name in ("a", "b", "a", "c"):
        lru.touch(name)
    assert list(lru) == ["a", "c"] and "b" not in lru


def test_adapter_of_reads_only_a_completion_bodys_model():
    base = frozenset({"tiny"})
    assert adapter_of(b'{"model": "ad", "prompt": "x"}', base) == "ad"
    assert adapter_of(b'{"model": "tiny"}', base) is None
    for bad in (b"not json", b"[1]", b'{"model": 3}', b"{}"):
        assert adapter_of(bad, base) is None  # the replica answers with its own 400


def test_merged_metrics_are_one_exposition_with_a_replica_label():
    from prometheus_client import CollectorRegistry, Histogram, generate_latest
    from prometheus_client import Counter as PCounter

    texts = {}
    for replica, n in (("r0", 2), ("r1", 5)):
        registry = CollectorRegistry()
        c = PCounter("loraplex_requests", "Finished requests", ["outcome"], registry=registry)
        c.labels("ok").inc(n)
        Histogram("loraplex_ttft_seconds", "TTFT", registry=registry).observe(0.1 * n)
        texts[replica] = generate_latest(registry).decode()
    merged = {f.name: f for f in text_string_to_metric_families(merge_metrics(texts))}
    totals = {s.labels["replica"]: s.value for s in merged["loraplex_requests"].samples
              if s.name == "loraplex_requests_total"}
    assert totals == {"r0": 2, "r1": 5}
    assert merged["loraplex_requests"].type == "counter"
    assert merged["loraplex_ttft_seconds"].type == "histogram"


# -- two replicas against one engine ------------------------------------------------------

MAX_MODEL_LEN = "512"  # room for a stream long enough to kill its replica mid-way


def _args(chat_model, adapter_dirs, keys_dir, *extra):
    return tenant_serve_args(chat_model, adapter_dirs, keys_dir, "--max-model-len", MAX_MODEL_LEN, *extra)


@pytest.fixture(scope="module")
def single(chat_model, adapter_dirs, tmp_path_factory):
    yield from running(_args(chat_model, adapter_dirs, tmp_path_factory.mktemp("keys")))


def _ray_fleet(argv):
    import ray
    from ray import serve

    from loraplex.deploy.args import serve_parser
    from loraplex.deploy.ray_serve import ENGINE_DEPLOYMENT, ServeFleet, application

    ray.init(num_cpus=4, include_dashboard=False, logging_level=logging.WARNING)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(application(serve_parser().parse_args([*argv, "--replicas", "2", "--cpus-per-replica", "1"])),
              name="loraplex", route_prefix="/")
    fleet = ServeFleet(serve.get_deployment_handle(ENGINE_DEPLOYMENT, "loraplex"))  # reaches each replica

    def kill(replica: str) -> None:
        name = next(a for a in ray.util.list_named_actors(all_namespaces=True) if replica in a["name"])
        ray.kill(ray.get_actor(name["name"], namespace=name["namespace"]))

    try:
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}", fleet=fleet, kill=kill, restarts=True)
    finally:
        ray.shutdown()  # (serve.shutdown waits on this process's handles, which outlive their loop)


def _data_parallel_fleet(argv):
    import uvicorn

    from loraplex.deploy.args import serve_parser
    from loraplex.deploy.data_parallel import HttpFleet, start_engines
    from loraplex.deploy.ingress import Ingress

    args = serve_parser().parse_args([*argv, "--data-parallel-size", "2"])
    processes, urls = start_engines(args, gpus=0)
    alive = dict(zip(urls, processes))
    fleet = HttpFleet(urls, AdapterAffinity(), 16, lambda r: alive[r].is_alive())
    ingress = Ingress(fleet, frozenset({"tiny"}))
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(ingress.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.02)
    # The test reads each engine straight through a fleet of its own (on its own loop).
    direct = SimpleNamespace(replicas=lambda: _coro(list(urls)),
                             forward_to=lambda r, req: HttpFleet({r: urls[r]}, None, 1).forward_to(r, req))
    try:
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}", fleet=direct,
                              kill=lambda replica: alive[replica].kill(), restarts=False)
    finally:
        uv.should_exit = True
        thread.join(10)
        for p in processes:
            p.kill()
            p.join(10)


async def _coro(value):
    return value


_LOOP = None


def _run(coro):
    """Run coro on one loop that lives as long as the tests (a Serve handle's router
    stays bound to the loop of its first call)."""
    global _LOOP
    if _LOOP is None:
        _LOOP = asyncio.new_event_loop()
        threading.Thread(target=_LOOP.run_forever, daemon=True).start()
    return asyncio.run_coroutine_threadsafe(coro, _LOOP).result(180)


@pytest.fixture(scope="module", params=["ray-serve", "data-parallel"])
def fleet(request, chat_model, adapter_dirs, tmp_path_factory):
    argv = _args(chat_model, adapter_dirs, tmp_path_factory.mktemp("keys"))
    yield from (_ray_fleet if request.param == "ray-serve" else _data_parallel_fleet)(argv)


def _complete(url, model, key=ADMIN, **kw):
    body = {"model": model, "prompt": "t5 t9 t12", "max_tokens": 6, "temperature": 0, **kw}
    r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                   timeout=120)
    return r


def test_replicas_answer_as_one_engine(fleet, single):
    for model, key in (("tiny", ADMIN), ("public-ad", GLOBEX), ("acme-ad", ACME), ("public-ad", ADMIN)):
        for kw in ({}, {"logprobs": 2, "prompt": "t7 t8"}, {"temperature": 1.0, "seed": 7, "n": 2}):
            one, many = _complete(single.url, model, key, **kw), _complete(fleet.url, model, key, **kw)
            assert one.status_code == many.status_code == 200, many.text
            a, b = one.json(), many.json()
            assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
            if "logprobs" in kw:
                for ca, cb in zip(a["choices"], b["choices"]):
                    assert ca["logprobs"]["tokens"] == cb["logprobs"]["tokens"]
                    # Ray gives each replica one thread (OMP_NUM_THREADS=1): sums in another order
                    assert ca["logprobs"]["token_logprobs"] == pytest.approx(cb["logprobs"]["token_logprobs"],
                                                                             abs=tolerance())
            assert b["loraplex"]["replica"] is not None and a["loraplex"]["replica"] is None
    chat = {"model": "public-ad", "messages": [{"role": "user", "content": "t4 t5"}], "max_tokens": 5,
            "temperature": 0}
    texts = []
    for url in (single.url, fleet.url):
        r = httpx.post(url + "/v1/chat/completions", json=chat, headers={"Authorization": f"Bearer {ADMIN}"})
        texts.append(r.json()["choices"][0]["message"]["content"])
        with httpx.stream("POST", url + "/v1/chat/completions", json={**chat, "stream": True},
                          headers={"Authorization": f"Bearer {ADMIN}"}) as s:
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        texts.append("".join(json.loads(e)["choices"][0]["delta"].get("content", "")
                             for e in events[:-1] if json.loads(e)["choices"]))
    assert len(set(texts)) == 1


def test_bad_input_and_tenants_behave_as_on_one_engine(fleet, single):
    cases = [("tiny", "sk-wrong", {}), ("acme-ad", GLOBEX, {}), ("no-such", ACME, {}),
             ("tiny", ADMIN, {"max_tokens": -1}), ("tiny", ADMIN, {"bogus_field": 1})]
    for model, key, kw in cases:
        one, many = _complete(single.url, model, key, **kw), _complete(fleet.url, model, key, **kw)
        assert one.status_code == many.status_code and one.status_code >= 400
        assert one.json()["error"] == many.json()["error"]
    for key in (GLOBEX, ACME):
        listing = [httpx.get(u + "/v1/models", headers={"Authorization": f"Bearer {key}"}).json()
                   for u in (single.url, fleet.url)]
        assert listing[0] == listing[1]
    r = httpx.post(fleet.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"},
                   headers={"Authorization": f"Bearer {ACME}"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    r = httpx.get(fleet.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    replicas = {s.labels.get("replica") for f in text_string_to_metric_families(r.text) for s in f.samples}
    assert r.status_code == 200 and len(replicas - {None}) == 2


def _listed_on_each_replica(fleet, name):
    async def listing():
        out = {}
        for replica in await fleet.fleet.replicas():
            req = Forwarded("GET", "/v1/models", headers=[("authorization", f"Bearer {ADMIN}")])
            status, _, body = await collect(fleet.fleet.forward_to(replica, req))
            out[replica] = name in {m["id"] for m in json.loads(body)["data"]}
        return out

    return _run(listing())


def test_load_and_unload_reach_every_replica(fleet, adapter_dirs):
    admin = {"Authorization": f"Bearer {ADMIN}"}
    path = str(adapter_dirs["qwen3"]["mlp-o-r16-patterns"])
    r = httpx.post(fleet.url + "/v1/load_lora_adapter", json={"lora_name": "third", "lora_path": path},
                   headers=admin)
    assert r.status_code == 200, r.text
    assert list(_listed_on_each_replica(fleet, "third").values()) == [True, True]
    bad = httpx.post(fleet.url + "/v1/load_lora_adapter", json={"lora_name": "broken", "lora_path": "/nope"},
                     headers=admin)
    assert bad.status_code == 400 and not any(_listed_on_each_replica(fleet, "broken").values())
    assert _complete(fleet.url, "third").status_code == 200
    r = httpx.post(fleet.url + "/v1/unload_lora_adapter", json={"lora_name": "third"}, headers=admin)
    assert r.status_code == 200 and not any(_listed_on_each_replica(fleet, "third").values())
    assert _complete(fleet.url, "third").status_code == 404


def test_requests_for_an_adapter_land_where_it_is_resident(fleet):
    models = ["public-ad", "acme-ad", "tiny"]
    for m in models[:2]:  # warm-up: each adapter's first request loads it somewhere
        assert _complete(fleet.url, m).status_code == 200
    time.sleep(0.5)  # the replicas' multiplexed ids reach the router
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda i: _complete(fleet.url, models[i % 3], max_tokens=3), range(60)))
    receipts = [a.json()["loraplex"] for a in answers]
    assert all(a.status_code == 200 for a in answers)
    adapter_receipts = [r for r in receipts if r["adapter"] is not None]
    resident = [r for r in adapter_receipts if r["adapter_source"] in ("host", "device")]
    tiers = Counter(r["adapter_source"] for r in adapter_receipts)
    assert len(resident) >= 0.9 * len(adapter_receipts), tiers
    # Base requests are pinned nowhere: alone, six at a time, they spread over both. (Beside
    # the adapters' traffic they may all go to the replica the adapters leave idle.)
    with ThreadPoolExecutor(6) as pool:
        base = list(pool.map(lambda i: _complete(fleet.url, "tiny", max_tokens=3), range(24)))
    assert all(a.status_code == 200 for a in base)
    assert len({a.json()["loraplex"]["replica"] for a in base}) == 2


def test_a_killed_replica_fails_only_its_own_streams(fleet, adapter_dirs):
    """...and, where the fleet replaces it (Ray Serve), the new replica gets the adapters
    loaded at runtime before it serves."""
    r = httpx.post(fleet.url + "/v1/load_lora_adapter", headers={"Authorization": f"Bearer {ADMIN}"},
                   json={"lora_name": "late", "lora_path": str(adapter_dirs["qwen3"]["mlp-o-r16-patterns"])})
    assert r.status_code == 200
    first = _complete(fleet.url, "public-ad").json()["loraplex"]["replica"]
    body = {"model": "public-ad", "prompt": "t5", "max_tokens": 480, "ignore_eos": True, "stream": True,
            "temperature": 0}
    admin = {"Authorization": f"Bearer {ADMIN}"}
    with httpx.stream("POST", fleet.url + "/v1/completions", json=body, headers=admin, timeout=120) as doomed:
        lines = doomed.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        other = {}
        survivor = threading.Thread(target=lambda: other.update(r=_complete(
            fleet.url, "tiny", max_tokens=200, ignore_eos=True)))
        survivor.start()
        time.sleep(0.3)
        fleet.kill(first)
        events = [line[6:] for line in lines if line.startswith("data: ")]
    survivor.join(120)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 503 and "failed mid-stream" in error["message"]
    assert other["r"].status_code == 200 and other["r"].json()["loraplex"]["replica"] != first
    after = _complete(fleet.url, "public-ad")  # new requests go to the replica left
    assert after.status_code == 200 and after.json()["loraplex"]["replica"] != first
    if fleet.restarts:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # (this process's router hears of the death late)
            now = _run(fleet.fleet.replicas())
            if len(now) == 2 and first not in now:
                break
            time.sleep(0.5)
        assert _complete(fleet.url, "tiny").status_code == 200  # the ingress meets the new replica
        assert list(_listed_on_each_replica(fleet, "late").values()) == [True, True]


def test_the_ray_application_takes_the_replica_and_autoscaling_flags(chat_model):
    from loraplex.deploy.args import serve_parser
    from loraplex.deploy.ray_serve import application

    args = serve_parser().parse_args([str(chat_model), "--replicas", "2", "--max-replicas", "6",
                                      "--gpus-per-replica", "0.5", "--target-ongoing-requests", "24",
                                      "--max-num-seqs", "48", "--max-cpu-loras", "100"])
    engines = application(args)._bound_deployment.init_args[0]._bound_deployment
    scaling = engines._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas, scaling.target_ongoing_requests) == (2, 6, 24)
    assert engines.ray_actor_options["num_gpus"] == 0.5
    router = engines._deployment_config.request_router_config
    assert router.request_router_kwargs == {"miss_cost": 2.0, "slots": 48, "resident_capacity": 100}


@pytest.mark.parametrize("flags", [["--replicas", "0"], ["--gpus-per-replica", "-1"],
                                   ["--route-miss-cost", "-2"], ["--data-parallel-size", "0"],
                                   ["--max-replicas", "x"]])
def test_bad_replica_flags_are_refused_by_the_parser(flags, chat_model, capsys):
    from loraplex.deploy.args import serve_parser

    with pytest.raises(SystemExit) as exit_:
        serve_parser().parse_args([str(chat_model), *flags])
    assert exit_.value.code == 2 and flags[0] in capsys.readouterr().err


def test_contradictory_replica_flags_fail_at_startup_with_one_line(chat_model, capsys):
    from loraplex.deploy.args import serve_parser
    from loraplex.deploy.ray_serve import application
    from loraplex.entrypoints.cli import main

    both = ["serve", str(chat_model), "--port", "0", "--replicas", "2", "--data-parallel-size", "2"]
    assert main(both) == 2
    assert "exclude each other" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--max-replicas must be at least --replicas"):
        application(serve_parser().parse_args([str(chat_model), "--replicas", "3", "--max-replicas", "2"]))
