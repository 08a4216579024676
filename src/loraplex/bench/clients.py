"""Two ways to drive a workload with at most C requests in flight, timing every token:
the engine in this process, or any OpenAI-compatible server over HTTP (streaming
/v1/completions, as `vllm bench serve` does)."""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque

from loraplex.bench.report import RequestRecord
from loraplex.bench.synthetic import word_prompt
from loraplex.bench.workload import BenchRequest
from loraplex.types import LoRARequest, SamplingParams


def run_in_process(engine, requests: list[BenchRequest], adapters: list[LoRARequest],
                   max_concurrency: int) -> list[RequestRecord]:
    """Feed `engine` (an LLMEngine) keeping `max_concurrency` requests in flight."""
    pending = deque(enumerate(requests))
    records: dict[str, RequestRecord] = {}
    in_flight = 0
    while pending or in_flight:
        while pending and in_flight < max_concurrency:
            i, req = pending.popleft()
            rid = f"bench-{i}"
            sp = SamplingParams(temperature=1.0, max_tokens=req.output_len, ignore_eos=True)
            lora = adapters[req.adapter] if req.adapter is not None else None
            records[rid] = RequestRecord(send_time=time.perf_counter())
            engine.add_request(rid, req.prompt_token_ids, sp, lora)
            in_flight += 1
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            rec = records[out.request_id]
            if out.error is not None:
                rec.error = str(out.error)
            rec.adapter_source = out.metrics.adapter_source
            rec.adapter_load_time = out.metrics.adapter_load_time
            n = len(out.outputs[0].token_ids)
            rec.token_times.extend([now] * (n - rec.num_output_tokens))
            rec.num_output_tokens = n
            if out.finished:
                in_flight -= 1
    return [records[f"bench-{i}"] for i in range(len(requests))]


async def _one_http(client, url: str, model: str, req: BenchRequest, rec: RequestRecord):
    body = {
        "model": model,
        "prompt": word_prompt(req.prompt_token_ids),
        "max_tokens": req.output_len,
        "ignore_eos": True,
        "temperature": 1.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    rec.send_time = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    rec.token_times.append(time.perf_counter())
                if chunk.get("usage"):
                    rec.num_output_tokens = chunk["usage"]["completion_tokens"]
        if not rec.num_output_tokens:
            rec.num_output_tokens = len(rec.token_times)
    except Exception as e:  # a failed request is reported, not fatal
        rec.error = f"{type(e).__name__}: {e}"


def run_http(base_url: str, model: str, requests: list[BenchRequest], adapter_names: list[str],
             max_concurrency: int, api_key: str | None = None) -> list[RequestRecord]:
    """Stream every request from `base_url`/v1/completions; `model` names the base model,
    an adapter request names its adapter."""
    import httpx

    async def main():
        sem = asyncio.Semaphore(max_concurrency)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=max_concurrency + 4)
        url = base_url.rstrip("/") + "/v1/completions"
        records = [RequestRecord(send_time=0.0) for _ in requests]
        async with httpx.AsyncClient(timeout=None, headers=headers, limits=limits) as client:
            async def guarded(req, rec):
                async with sem:
                    name = adapter_names[req.adapter] if req.adapter is not None else model
                    await _one_http(client, url, name, req, rec)

            await asyncio.gather(*(guarded(q, r) for q, r in zip(requests, records)))
        return records

    return asyncio.run(main())
