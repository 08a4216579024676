"""`loraplex bench`: workloads, metrics, the in-process driver on a tiny model, and the
HTTP driver against a streaming OpenAI-style server."""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from speculation import AlwaysSeen, repeat_last_on_device

from loraplex.bench.clients import run_http
from loraplex.bench.report import RequestRecord, summarize
from loraplex.bench.workload import make_requests
from loraplex.entrypoints.cli import main as cli


def test_workload_shapes_and_popularity():
    reqs = make_requests(2000, 7, 3, vocab_size=5000, num_adapters=10, distribution="zipf", seed=0)
    assert all(len(r.prompt_token_ids) == 7 and r.output_len == 3 for r in reqs)
    counts = [sum(r.adapter == k for r in reqs) for k in range(10)]
    assert counts[0] > 2 * counts[4] > 0, counts  # P(k) ~ 1 / (k + 1)
    uniform = make_requests(2000, 7, 3, 5000, 10, "uniform", 0)
    assert max(sum(r.adapter == k for r in uniform) for k in range(10)) < 260
    assert all(r.adapter is None for r in make_requests(5, 7, 3, 5000, 0, "uniform", 0))


def test_prefix_repetition_gives_each_adapter_its_own_prefix():
    reqs = make_requests(60, 10, 3, 5000, 4, "uniform", 0, prefix_len=6)
    assert all(len(r.prompt_token_ids) == 10 for r in reqs)
    prefixes = {r.adapter: r.prompt_token_ids[:6] for r in reqs}
    assert all(r.prompt_token_ids[:6] == prefixes[r.adapter] for r in reqs)
    assert len({tuple(p) for p in prefixes.values()}) == 4
    assert len({tuple(r.prompt_token_ids[6:]) for r in reqs}) == 60, "the rest is each prompt's own"
    base = make_requests(10, 10, 3, 5000, 0, "uniform", 0, prefix_len=6, num_prefixes=2)
    assert len({tuple(r.prompt_token_ids[:6]) for r in base}) == 2


def test_bench_prefix_repetition_hits_the_cache(model_dirs, tmp_path, capsys):
    out = tmp_path / "result.json"
    common = ["bench", "--model", str(model_dirs["qwen3"]), "--dataset-name", "prefix_repetition",
              "--prefix-repetition-prefix-len", "48", "--prefix-repetition-suffix-len", "8",
              "--prefix-repetition-output-len", "3", "--num-prompts", "8", "--max-concurrency", "2",
              "--num-adapters", "2", "--lora-rank", "4", "--dtype", "float32",
              "--cache-dir", str(tmp_path / "cache"), "--result-json", str(out)]
    assert cli(common) == 0
    printed = capsys.readouterr().out
    assert "56 (prefix 48)/3" in printed and "of prompt tokens from the prefix cache" in printed
    hit = json.loads(out.read_text())[0]["extra"]["prefix_cache_hit_rate"]
    assert 0.4 < hit < 0.86, hit  # the later requests of each adapter: their 48-token prefix
    assert cli(common + ["--no-enable-prefix-caching"]) == 0
    assert "prefix_cache_hit_rate" not in json.loads(out.read_text())[0]["extra"]


def test_metrics_follow_vllm_definitions():
    recs = [RequestRecord(send_time=0.0, token_times=[0.1, 0.12, 0.16], num_output_tokens=3),
            RequestRecord(send_time=0.05, token_times=[0.25, 0.30], num_output_tokens=2)]
    r = summarize("x", recs)
    assert r.ttft_ms["median"] == pytest.approx(150.0)  # 100 and 200 ms
    assert sorted(r.tpots) == pytest.approx([0.03, 0.05])  # (0.16-0.1)/2, (0.30-0.25)/1
    assert r.itl_ms["mean"] == pytest.approx((20 + 40 + 50) / 3)
    assert r.output_throughput == pytest.approx(5 / 0.30)


def test_bench_in_process_on_a_tiny_model(model_dirs, tmp_path, capsys):
    out = tmp_path / "result.json"
    code = cli(["bench", "--model", str(model_dirs["qwen3"]), "--num-prompts", "6",
                "--input-len", "12", "--output-len", "5", "--max-concurrency", "3",
                "--num-adapters", "0", "2", "--lora-rank", "4", "--dtype", "float32",
                "--cache-dir", str(tmp_path / "cache"), "--result-json", str(out)])
    assert code == 0
    table = capsys.readouterr().out
    assert "| run |" in table and "2 adapters (uniform)" in table
    assert "2 adapters (uniform): " in table and " x base throughput, TTFT p99 " in table
    rows = json.loads(out.read_text())
    assert [r["num_requests"] - r["num_failed"] for r in rows] == [6, 6]
    assert all(r["output_throughput"] > 0 and r["tpot_ms"]["median"] > 0 for r in rows)


@pytest.mark.parametrize("registry", [False, True])
def test_bench_cold_adapters(model_dirs, tmp_path, capsys, registry):
    """Adapters start on disk (or in a registry): every request's adapter loads while the
    run goes on, through 2 GPU slots and 3 host entries; the report counts the tiers."""
    out = tmp_path / "result.json"
    code = cli(["bench", "--model", str(model_dirs["qwen3"]), "--num-prompts", "12",
                "--input-len", "8", "--output-len", "4", "--max-concurrency", "4",
                "--num-adapters", "40", "--adapter-dist", "uniform", "zipf", "--cold-adapters",
                "--max-loras", "2", "--max-cpu-loras", "3", "--lora-rank", "4", "--dtype", "float32",
                "--cache-dir", str(tmp_path / "cache"), "--result-json", str(out), "--sample-stacks",
                *(["--adapter-registry"] if registry else [])])
    assert code == 0
    printed = capsys.readouterr().out
    assert "40 adapters (zipf, cold)" in printed and "runner.launch in" in printed
    rows = json.loads(out.read_text())
    stacks = rows[0]["extra"]["launch_stacks"]
    assert stacks["samples"] > 0 and 0 <= stacks["inside"] <= stacks["samples"]
    assert [r["num_failed"] for r in rows] == [0, 0]
    tiers = rows[0]["extra"]["adapter_tiers"]
    assert sum(tiers.values()) == 12 and tiers.get("disk", 0) >= 6
    assert rows[0]["extra"]["adapter_load_ms"]["median"] > 0
    assert all(row["count"] > 0 and "loraplex/" in row["loraplex"] for row in stacks["top"])


class _FakeOpenAI(BaseHTTPRequestHandler):
    """Streams `max_tokens` one-word chunks, then usage, like /v1/completions."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append(body)
        if body["model"] == "missing":
            self.send_response(404)
            self.end_headers()
            self.wfile.write(b'{"error": {"message": "no such model"}}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(body["max_tokens"]):
            time.sleep(0.01)
            chunk = {"choices": [{"index": 0, "text": f" w{i}"}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_server():
    """A _FakeOpenAI server on a free loopback port, with .url and .seen (request bodies)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    server.seen = []
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


def test_bench_over_http(fake_server):
    reqs = make_requests(8, 4, 5, vocab_size=100, num_adapters=2, distribution="uniform", seed=1)
    records = run_http(fake_server.url, "base-model", reqs, ["ad-0", "missing"], max_concurrency=3)
    ok = [r for r, q in zip(records, reqs) if q.adapter != 1]
    assert all(r.error is None and r.num_output_tokens == 5 and len(r.token_times) == 5 for r in ok)
    assert all(r.error.startswith("HTTP 404") for r, q in zip(records, reqs) if q.adapter == 1)
    assert {b["model"] for b in fake_server.seen} <= {"ad-0", "missing"}
    assert all(b["stream"] and b["ignore_eos"] and b["prompt"].startswith("t") for b in fake_server.seen)
    result = summarize("http", records)
    assert result.num_failed == sum(q.adapter == 1 for q in reqs)
    assert 10 <= result.itl_ms["median"] <= 200


def test_step_profile_splits_time_by_kind_of_step():
    from loraplex.bench.profile import step_profile
    from loraplex.runner.step_outputs import StepTiming

    def step(total_s, tokens, loads, launch_s, slot_s, device=None):
        return StepTiming(tokens, loads, launch_s, slot_s, total_s, device)

    log = ([step(0.006, 32, 0, 0.001, 0.0)] * 20 + [step(0.015, 544, 0, 0.002, 0.0)] * 4
           + [step(0.2, 32, 1, 0.1, 0.05), step(0.007, 33, 2, 0.003, 0.002)])
    p = step_profile(log)
    assert p["median_ms"] == 6.0 and p["decode_only"]["steps"] == 20
    assert p["with_prefill"]["steps"] == 4 and p["with_slot_loads"]["steps"] == 2
    assert p["slow"]["steps"] == 1 and p["slow"]["mean_slot_loads"] == 1 and p["slow"]["launch_ms"] == 100.0
    assert p["with_slot_loads"]["slot_copy_ms"] == 26.0
    assert abs(p["total_s"] - (0.12 + 0.06 + 0.207)) < 1e-6
    assert "device_ms" not in p["decode_only"]
    assert step_profile([]) == {}

    class Event:  # a CUDA timing event's elapsed_time, in milliseconds
        def __init__(self, t):
            self.t = t

        def elapsed_time(self, end):
            return end.t - self.t

    timed = step_profile([step(0.006, 32, 0, 0.001, 0.0, (Event(1.0), Event(6.5)))] * 3
                         + [step(0.006, 32, 0, 0.001, 0.0)])
    assert timed["decode_only"]["device_ms"] == 5.5 and timed["decode_only"]["steps"] == 4


def test_compiled_kernels_reports_variants_compiled_meanwhile():
    """The bench's check that its warm-up compiled everything: a kernel first compiled
    inside the block is listed (on CPU Triton's interpreter compiles nothing, so the
    hook is driven by hand, as Triton calls it)."""
    from triton import knobs

    from loraplex.bench.profile import compiled_kernels

    before = knobs.runtime.jit_post_compile_hook
    with compiled_kernels() as compiled:
        knobs.runtime.jit_post_compile_hook(key=1, repr="_rotary_kernel[num_warps=4](...)", fn=None,
                                            compile={}, is_manual_warmup=False, already_compiled=False)
    assert len(compiled) == 1 and compiled[0].startswith("_rotary_kernel[num_warps=4](...) called from ")
    assert "test_bench.py" not in compiled[0]  # only loraplex's own calls are named
    assert knobs.runtime.jit_post_compile_hook is before


def _cli(argv: list[str]) -> int:
    """cli(argv)'s exit status, argparse's SystemExit included."""
    try:
        return cli(argv)
    except SystemExit as e:
        return e.code


def _one_line_error(capsys) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert "nan" not in out and len(lines) == 1 and lines[0].startswith("loraplex: error: "), (out, err)
    return lines[0]


def test_bench_over_http_names_the_servers_adapters(fake_server, model_dirs, tmp_path, capsys):
    """--lora-modules: each request names one of the server's adapters, uniformly, as in
    vllm bench serve, whose flag names for the random dataset are accepted too."""
    code = _cli(["bench", "--model", str(model_dirs["qwen3"]), "--base-url", fake_server.url,
                 "--dataset-name", "random", "--random-input-len", "4", "--random-output-len", "3",
                 "--num-prompts", "16", "--max-concurrency", "4", "--lora-modules", "ad-0", "ad-1",
                 "--result-json", str(tmp_path / "r.json")])
    assert code == 0
    assert "2 adapters (uniform)" in capsys.readouterr().out
    assert sorted({b["model"] for b in fake_server.seen}) == ["ad-0", "ad-1"]
    assert all(b["max_tokens"] == 3 and len(b["prompt"].split()) == 4 for b in fake_server.seen)
    assert json.loads((tmp_path / "r.json").read_text())[0]["num_failed"] == 0


def test_bench_over_http_wants_adapter_names(fake_server, model_dirs, capsys):
    """--num-adapters K makes adapters in process; a server's adapter names are not guessed."""
    code = _cli(["bench", "--model", str(model_dirs["qwen3"]), "--base-url", fake_server.url,
                 "--num-prompts", "4", "--num-adapters", "2"])
    assert code == 2 and "--lora-modules" in _one_line_error(capsys)
    assert fake_server.seen == []
    code = _cli(["bench", "--model", str(model_dirs["qwen3"]), "--lora-modules", "ad-0"])
    assert code == 2 and "--base-url" in _one_line_error(capsys)


@pytest.mark.parametrize("case", ["unreachable", "unknown adapter"])
def test_bench_stops_when_every_request_fails(fake_server, model_dirs, capsys, case):
    """No table of nan: one line with the first failure's message, and a non-zero status."""
    url, extra = (("http://127.0.0.1:1", []) if case == "unreachable"
                  else (fake_server.url, ["--lora-modules", "missing"]))
    code = _cli(["bench", "--model", str(model_dirs["qwen3"]), "--base-url", url,
                 "--num-prompts", "3", "--input-len", "4", "--output-len", "2", *extra])
    line = _one_line_error(capsys)
    assert code == 2 and "3 requests failed" in line
    assert ("ConnectError" if case == "unreachable" else "HTTP 404") in line


def test_bench_dataset_names_are_random_and_prefix_repetition(capsys):
    assert _cli(["bench", "--model", "m", "--dataset-name", "sharegpt"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--dataset-name: invalid choice: 'sharegpt' (choose from" in line and "prefix_repetition" in line


def test_plot_needs_matplotlib_before_any_run(monkeypatch, tmp_path, capsys):
    from loraplex.bench import run

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    monkeypatch.setattr(run, "prepare_model_dir", lambda *a: pytest.fail("the run started"))
    code = _cli(["bench", "--model", "qwen3-0.6b", "--plot", str(tmp_path / "p.png")])
    assert code == 2 and "pip install 'loraplex[plot]'" in _one_line_error(capsys)


def test_plot_runs_share_bins(monkeypatch, tmp_path):
    """A tight run stays visible beside a wide one: every run of a panel is binned with the
    same edges, which span all of them."""
    from matplotlib.axes import Axes

    from loraplex.bench.report import plot

    drawn = []
    hist = Axes.hist

    def spy(ax, x, *args, **kwargs):
        counts, edges, patches = hist(ax, x, *args, **kwargs)
        drawn.append((id(ax), np.asarray(x), edges))
        return counts, edges, patches

    monkeypatch.setattr(Axes, "hist", spy)

    def run(label, ttfts, tpot, spread=0.01):
        tpots = tpot * (1 + spread * (np.arange(len(ttfts)) % 5))
        recs = [RequestRecord(send_time=0.0, token_times=[t, t + tpot, t + 2 * tpot], num_output_tokens=3)
                for t, tpot in zip(ttfts, tpots)]
        return summarize(label, recs)

    tight = run("tight", 0.100 + 0.001 * np.arange(50) / 50, 0.010)
    wide = run("wide", np.linspace(0.05, 0.5, 50), 0.040)
    plot([tight, wide], str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 0
    panels = {}
    for key, x, edges in drawn:
        panels.setdefault(key, []).append((x, edges))
    assert len(panels) == 2 and all(len(runs) == 2 for runs in panels.values())
    for (x0, e0), (x1, e1) in panels.values():
        assert np.array_equal(e0, e1)
        assert e0[0] <= min(x0.min(), x1.min()) and e0[-1] >= max(x0.max(), x1.max())
    # One TPOT for every request (up to rounding) has no range to split into bins.
    plot([run("steady", 0.1 + 0.001 * np.arange(50), 0.010, spread=0)], str(tmp_path / "p.png"))


def test_bench_reports_speculation(model_dirs, tmp_path, capsys, monkeypatch):
    """The share of proposals kept and tokens per verified step, with proposals made
    on the device (each repeats the last token: random text seldom repeats itself)."""
    import loraplex.engine.scheduler as scheduler_module
    from loraplex.runner import ngram_drafts

    monkeypatch.setattr(scheduler_module, "SeenSuffix", AlwaysSeen)
    real = ngram_drafts.ops.ngram_inputs
    monkeypatch.setattr(ngram_drafts.ops, "ngram_inputs", repeat_last_on_device(real))
    out = tmp_path / "result.json"
    assert cli(["bench", "--model", str(model_dirs["qwen3"]), "--num-prompts", "6", "--input-len", "24",
                "--output-len", "24", "--max-concurrency", "3", "--num-adapters", "0", "--dtype", "float32",
                "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
                "--cache-dir", str(tmp_path / "cache"), "--result-json", str(out)]) == 0
    printed = capsys.readouterr().out
    extra = json.loads(out.read_text())[0]["extra"]
    assert extra["spec_proposed_tokens"] > 0
    assert f"speculation: {extra['spec_proposed_tokens']} tokens proposed, " in printed
    assert 0 <= extra["spec_acceptance_rate"] <= 1 and extra["spec_mean_accepted_length"] >= 1
