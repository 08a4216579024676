"""Per-request timings -> the metrics `vllm bench serve` reports, as a table, JSON, plot.

TTFT: send -> first token. TPOT: (last token - first token) / (tokens - 1) per request.
ITL: every gap between consecutive tokens of a request. Output throughput: all output
tokens over the wall time from the first send to the last token.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np

from loraplex.errors import LoraplexError


@dataclass
class RequestRecord:
    send_time: float
    token_times: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    error: str | None = None
    adapter_source: str | None = None  # the tier its adapter came from (receipt)
    adapter_load_time: float | None = None


@dataclass
class BenchResult:
    label: str
    num_requests: int
    num_failed: int
    duration_s: float
    output_throughput: float  # tokens / s
    request_throughput: float  # requests / s
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    extra: dict = field(default_factory=dict)
    ttfts: list[float] = field(default_factory=list, repr=False)
    tpots: list[float] = field(default_factory=list, repr=False)


def _stats(values_s: list[float]) -> dict[str, float]:
    if not values_s:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    v = np.asarray(values_s) * 1e3
    return {"mean": float(v.mean()), "median": float(np.median(v)), "p99": float(np.percentile(v, 99))}


def summarize(label: str, records: list[RequestRecord], extra: dict | None = None) -> BenchResult:
    ok = [r for r in records if r.error is None and r.token_times]
    start = min(r.send_time for r in records)
    end = max((r.token_times[-1] for r in ok), default=start)
    duration = max(end - start, 1e-9)
    ttfts = [r.token_times[0] - r.send_time for r in ok]
    tpots = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1)
             for r in ok if len(r.token_times) > 1]
    itls = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:])]
    tiers = Counter(r.adapter_source for r in records if r.adapter_source)
    loads = [r.adapter_load_time for r in records if r.adapter_load_time is not None]
    extra = dict(extra or {})
    if tiers:
        extra["adapter_tiers"] = dict(tiers)
    if loads:
        extra["adapter_load_ms"] = _stats(loads)
    return BenchResult(
        label=label,
        num_requests=len(records),
        num_failed=len(records) - len(ok),
        duration_s=duration,
        output_throughput=sum(r.num_output_tokens for r in ok) / duration,
        request_throughput=len(ok) / duration,
        ttft_ms=_stats(ttfts),
        tpot_ms=_stats(tpots),
        itl_ms=_stats(itls),
        extra=extra,
        ttfts=ttfts,
        tpots=tpots,
    )


def format_table(results: list[BenchResult]) -> str:
    head = ("| run | requests | output tok/s | TTFT median / p99 (ms) | TPOT median / p99 (ms) "
            "| ITL median (ms) |")
    lines = [head, "|" + "---|" * 6]
    for r in results:
        lines.append(
            f"| {r.label} | {r.num_requests - r.num_failed}/{r.num_requests} "
            f"| {r.output_throughput:,.0f} "
            f"| {r.ttft_ms['median']:.1f} / {r.ttft_ms['p99']:.1f} "
            f"| {r.tpot_ms['median']:.2f} / {r.tpot_ms['p99']:.2f} "
            f"| {r.itl_ms['median']:.2f} |"
        )
    return "\n".join(lines)


def to_json(results: list[BenchResult]) -> str:
    def row(r):
        d = asdict(r)
        d.pop("ttfts")
        d.pop("tpots")
        return d

    return json.dumps([row(r) for r in results], indent=2)


def require_matplotlib() -> None:
    """Fail before the runs, not after them, when --plot cannot draw."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise LoraplexError("--plot needs matplotlib: pip install 'loraplex[plot]'") from None


def plot(results: list[BenchResult], path: str) -> None:
    """Histograms of TTFT and TPOT per run, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, name, per_run in ((axes[0], "TTFT", [r.ttfts for r in results]),
                              (axes[1], "TPOT", [r.tpots for r in results])):
        values = [np.asarray(v) * 1e3 for v in per_run]
        edges = _shared_edges(values)
        for r, v in zip(results, values):
            ax.hist(v, bins=edges, alpha=0.5, label=r.label)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("requests")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _shared_edges(values: list[np.ndarray], bins: int = 40) -> np.ndarray:
    """Bin edges over every run's values: with bins of its own, a tight run is drawn as
    slivers too thin to see beside a wide one."""
    v = np.concatenate(values)
    lo, hi = (float(v.min()), float(v.max())) if v.size else (0.0, 1.0)
    if hi - lo <= 1e-9 * max(abs(hi), 1.0):  # one value, up to rounding: nothing to split
        lo, hi = lo - 0.5, hi + 0.5
    return np.linspace(lo, hi, bins + 1)
