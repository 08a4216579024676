"""Scheduling must never change what a request generates: chunked prefill, preemption
by recompute, stop conditions and seeded sampling."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import ADAPTERS, batch_tolerance, make_llm, random_prompts

from loraplex import LoRARequest, SamplingParams


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _loras(adapter_dirs, arch, n):
    adapters = [None] + [
        LoRARequest(name, i + 1, str(adapter_dirs[arch][name])) for i, name in enumerate(ADAPTERS)
    ]
    return [adapters[i % len(adapters)] for i in range(n)]


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded-sampling"])
def test_chunked_prefill_changes_no_token(model_dirs, adapter_dirs, seeded):
    prompts = random_prompts(6, (20, 60), seed=4)
    loras = _loras(adapter_dirs, "llama", len(prompts))
    sp = [
        SamplingParams(temperature=0.8 if seeded else 0, seed=100 + i if seeded else None,
                       max_tokens=10, ignore_eos=True, prompt_logprobs=0)
        for i in range(len(prompts))
    ]
    whole = make_llm(model_dirs["llama"]).generate(prompts, sp, loras)
    llm = make_llm(model_dirs["llama"], max_num_batched_tokens=16)
    chunked = llm.generate(prompts, sp, loras)
    assert _tokens(chunked) == _tokens(whole)
    for a, b, p in zip(whole, chunked, prompts):
        assert len(b.prompt_logprobs) == len(p)
        da = torch.tensor([x[t].logprob for x, t in zip(a.prompt_logprobs[1:], p[1:])])
        db = torch.tensor([x[t].logprob for x, t in zip(b.prompt_logprobs[1:], p[1:])])
        assert (da - db).abs().max().item() <= batch_tolerance()


def test_preemption_by_recompute_changes_no_token(model_dirs, adapter_dirs):
    prompts = random_prompts(8, (30, 50), seed=5)
    loras = _loras(adapter_dirs, "qwen3", len(prompts))
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=0)
    roomy = make_llm(model_dirs["qwen3"]).generate(prompts, sp, loras)
    # 16 pages of 16 tokens hold ~3 of these requests at full length: the rest must wait
    # or be preempted and recomputed.
    tight = make_llm(model_dirs["qwen3"], num_gpu_blocks_override=16, max_model_len=128)
    outs = tight.generate(prompts, sp, loras)
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "the test should preempt"
    assert _tokens(outs) == _tokens(roomy)
    for a, b in zip(roomy, outs):  # prompt logprobs are not scored twice after recompute
        assert len(b.prompt_logprobs) == len(a.prompt_logprobs)
    assert tight.engine.scheduler.blocks.num_free_blocks == 16


@pytest.mark.parametrize("truncated", [True, False], ids=["top-k-top-p", "temperature-only"])
def test_seeded_sampling_is_reproducible_and_batch_independent(model_dirs, truncated):
    """Both sampling paths: top-k / top-p (torch, per-request generators) and
    temperature only (the fused race, keyed by seed and token index)."""
    llm = make_llm(model_dirs["qwen2"])
    prompts = random_prompts(5, (5, 20), seed=6)
    sp = SamplingParams(temperature=1.0, top_p=0.9 if truncated else 1.0, top_k=50 if truncated else 0,
                        seed=1234, max_tokens=12, ignore_eos=True)
    together = _tokens(llm.generate(prompts, sp))
    again = _tokens(llm.generate(prompts[::-1], sp))[::-1]
    alone = [_tokens(llm.generate([p], sp))[0] for p in prompts]
    assert together == again == alone
    unseeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    assert _tokens(llm.generate(prompts, unseeded)) != together


def test_stop_conditions(model_dirs):
    llm = make_llm(model_dirs["qwen3"])
    prompt = random_prompts(1, (10, 11), seed=7)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    tokens = free.outputs[0].token_ids
    assert free.outputs[0].finish_reason == "length" and len(tokens) == 12

    # stop_token_ids: ends on the token, keeps it in token_ids, not in text.
    stop_at = tokens[4]
    first = tokens.index(stop_at)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at]))[0]
    assert out.outputs[0].token_ids == tokens[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_at
    assert f"t{stop_at}" not in out.outputs[0].text.split()[-1:]

    # stop strings: text cut before the stop string (or after it, when asked).
    words = free.outputs[0].text.split()
    stop = f"{words[2]} {words[3]}"
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop=[stop]))[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.outputs[0].text == free.outputs[0].text[: free.outputs[0].text.index(stop)]
    out = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=12, stop=[stop], include_stop_str_in_output=True),
    )[0]
    assert out.outputs[0].text.endswith(stop)

    # min_tokens: the stop token cannot end generation early.
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, min_tokens=8, stop_token_ids=[stop_at])
    )[0]
    assert len(out.outputs[0].token_ids) >= 8
    assert stop_at not in out.outputs[0].token_ids[:8]

    # EOS ends generation unless ignore_eos; max_model_len caps everything.
    eos_free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert eos_free[0].outputs[0].finish_reason == "length"
    short = make_llm(model_dirs["qwen3"], max_model_len=len(prompt) + 5)
    out = short.generate([prompt], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 5


def test_eos_stops_generation(model_dirs, tmp_path):
    """A model whose config names a frequent token as EOS stops at its first occurrence."""
    llm = make_llm(model_dirs["qwen3"])
    prompt = random_prompts(1, (10, 11), seed=8)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    tokens = free[0].outputs[0].token_ids
    eos = tokens[3]
    model_dir = tmp_path / "model"
    shutil.copytree(model_dirs["qwen3"], model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["eos_token_id"] = eos
    (model_dir / "config.json").write_text(json.dumps(config))

    llm = make_llm(model_dir)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert out.token_ids == tokens[: tokens.index(eos) + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert out[0].outputs[0].token_ids == tokens


def test_async_scheduling_changes_nothing(model_dirs, adapter_dirs):
    """Planning a step before reading the last one's tokens gives the same outputs as
    planning after: with EOS found late, stop strings, stop tokens, preemption. In
    float32 on any device: async steps have other batch shapes, which bf16 rounds
    differently (a scheduling test, not a numerics one)."""
    prompts = random_prompts(10, (20, 45), seed=12)
    loras = _loras(adapter_dirs, "llama", len(prompts))
    sync = make_llm(model_dirs["llama"], async_scheduling=False, num_gpu_blocks_override=20,
                    max_model_len=128, dtype="float32")
    free = sync.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), loras)
    params = []
    for i, out in enumerate(free):
        toks, words = out.outputs[0].token_ids, out.outputs[0].text.split()
        kind = i % 4
        if kind == 0:
            params.append(SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[toks[5]]))
        elif kind == 1:
            params.append(SamplingParams(temperature=0, max_tokens=24, stop=[words[7]]))
        elif kind == 2:
            params.append(SamplingParams(temperature=0.9, seed=i, max_tokens=17 + i, ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2))
    a = sync.generate(prompts, params, loras)
    eager = make_llm(model_dirs["llama"], async_scheduling=True, num_gpu_blocks_override=20,
                     max_model_len=128, dtype="float32")
    b = eager.generate(prompts, params, loras)
    assert sum(o.metrics.num_preemptions for o in b) > 0, "the test should preempt"
    for x, y in zip(a, b):
        ox, oy = x.outputs[0], y.outputs[0]
        assert (ox.token_ids, ox.text, ox.finish_reason, ox.stop_reason) == (
            oy.token_ids, oy.text, oy.finish_reason, oy.stop_reason)
        if ox.logprobs is not None:
            assert [set(p) for p in ox.logprobs] == [set(p) for p in oy.logprobs]
    assert eager.engine.scheduler.blocks.num_free_blocks == 20


def test_graph_capture_runs_without_garbage_collection(monkeypatch):
    """A finalizer run inside a CUDA graph capture (a dead engine's pinned pool calls
    cudaHostUnregister) invalidates the capture: garbage is collected before, and the
    collector is off during, capture."""
    import gc

    from loraplex.runner.cuda_graphs import StepGraphs

    graphs = StepGraphs(model=None, inputs=None, max_batch=4, max_tokens=None, with_lora=False)
    seen = []
    monkeypatch.setattr(graphs, "_capture", lambda: seen.append(gc.isenabled()))
    assert gc.isenabled()
    graphs.capture()
    assert seen == [False] and gc.isenabled()


def test_next_step_inputs_leave_the_previous_steps_staging_alone():
    """A step's host-to-device input copies can still be queued (behind its adapter slot
    copies) when the host fills the next step's inputs: on a GPU each step writes the
    other of two pinned twins, so the previous step's values are intact until its copies
    ran. (On CPU the buffers are the tensors ops read: one of each.)"""
    from conftest import DEVICE

    from loraplex.runner.batch_meta import InputBuffers
    from loraplex.types import ScheduledChunk, StepPlan

    def plan(tokens):
        return StepPlan([ScheduledChunk("r", tokens, 0, [0, 1], -1, True, SamplingParams(), 0)])

    bufs = InputBuffers(max_tokens=16, max_seqs=4, max_blocks_per_seq=4, max_loras=2, block_size=16,
                        device=torch.device(DEVICE))

    def staged(twin):  # the token ids as the host twin `twin` holds them
        return bufs.layout(3, 1, False).np[twin]["input_ids"].tolist()

    bufs.prepare(plan([5, 6, 7]), [0, 0])
    if DEVICE == "cpu":
        assert len(bufs.arena.hosts) == 1
        return
    first = bufs.arena.turn
    bufs.prepare(plan([8, 9, 4]), [0, 0])
    assert bufs.arena.turn != first and staged(first) == [5, 6, 7] and staged(bufs.arena.turn) == [8, 9, 4]
    bufs.prepare(plan([1, 2, 3]), [0, 0])
    assert bufs.arena.turn == first, "two twins, in turn"


def test_a_step_of_a_graphs_shape_is_staged_where_the_graph_reads():
    """A CUDA graph reads its inputs at the addresses it was captured with: every later
    step of its shape is staged there (also after the layout cache was emptied), and
    its own values land in them in one copy."""
    from conftest import DEVICE

    from loraplex.runner.batch_meta import GraphShape, InputBuffers
    from loraplex.types import ScheduledChunk, StepPlan

    bufs = InputBuffers(max_tokens=32, max_seqs=4, max_blocks_per_seq=4, max_loras=2, block_size=4,
                        device=torch.device(DEVICE))
    shape = GraphShape(4, 4, 1)
    captured = bufs.graph_inputs(shape, with_lora=True)
    chunks = [ScheduledChunk(f"r{i}", [10 + i], 5 + i, [i, 4 + i], i - 1, True, SamplingParams(), 0)
              for i in range(3)]
    for clear in (False, True):
        if clear:
            bufs.arena._layouts.clear()
        step = bufs.prepare(StepPlan(chunks), [8, 8], graph=shape)
        for a, b in [(captured.input_ids, step.input_ids), (captured.positions, step.positions),
                     (captured.attn.slot_mapping, step.attn.slot_mapping),
                     (captured.attn.seq_lens, step.attn.seq_lens),
                     (captured.lora.token_slot, step.lora.token_slot),
                     (captured.lora.group_starts, step.lora.group_starts)]:
            assert a.data_ptr() == b.data_ptr() and a.shape == b.shape
        assert step.input_ids.tolist() == [10, 11, 12, 0] and step.positions.tolist() == [5, 6, 7, 0]
        assert step.attn.slot_mapping.tolist() == [4 * 4 + 1, 5 * 4 + 2, 6 * 4 + 3, -1]  # the second pages
        assert step.attn.seq_lens.tolist() == [6, 7, 8, 0]
        assert step.lora.token_slot.tolist() == [-1, 0, 1, -1]
        assert step.sample_rows.tolist() == [0, 1, 2]


class _EagerGraphs:
    """Stands in for the runner's CUDA graphs on any device: each step is padded to the
    shape of the graph that would run it, then run eagerly on those padded inputs."""

    def __init__(self, runner, max_batch: int):
        from loraplex.runner.cuda_graphs import StepGraphs

        self.graphs = StepGraphs(runner.model, runner.inputs, max_batch,
                                 runner.config.scheduler.max_num_batched_tokens, True,
                                 short_chunks=runner._short_chunk_graphs(max_batch))
        self.model, self.shapes = runner.model, []
        prepare = runner.inputs.prepare

        def remember(plan, *args, **kwargs):
            self.step, self.num_tokens = prepare(plan, *args, **kwargs), plan.num_tokens
            return self.step

        runner.inputs.prepare = remember

    def shape_for(self, num_tokens, num_seqs, max_query_len):
        return self.graphs.shape_for(num_tokens, num_seqs, max_query_len)

    def replay(self, shape, with_lora, router_lora=True):
        from loraplex.layers.context import ForwardContext, forward_context

        step = self.step
        assert step.input_ids.shape[0] == shape.tokens and (step.lora is not None) == with_lora
        self.shapes.append((shape, int(self.num_tokens < shape.tokens)))
        # A graph's kernels read the device tensors alone, which the runner may have
        # completed after prepare() (speculation planned ahead: runner/ngram_drafts.py);
        # the reference ops run here read the host copies.
        step.attn.seq_lens_cpu = step.attn.seq_lens.tolist()
        step.attn.max_seq_len = max(step.attn.seq_lens_cpu)
        with forward_context(ForwardContext(attn=step.attn, lora=step.lora, router_lora=router_lora)):
            return self.model(step.input_ids, step.positions)


def test_verification_steps_padded_to_a_short_chunk_graph_change_no_token(model_dirs, adapter_dirs):
    """Speculation's verification steps padded as their short-chunk graph runs them
    (one-token padding sequences, then empty ones) give the tokens of unpadded steps,
    base rows beside adapters."""
    prompts = [([7 + i, 40 + i, 90, 13 + 2 * i] * 4)[: 9 + i] for i in range(3)]  # n-gram matches
    prompts += random_prompts(3, (5, 20), seed=11)
    loras = _loras(adapter_dirs, "llama", len(prompts))
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kw = dict(dtype="float32", enforce_eager=True, speculative_config={"method": "ngram",
                                                                       "num_speculative_tokens": 3})
    expected = make_llm(model_dirs["llama"], **kw).generate(prompts, sp, loras)
    llm = make_llm(model_dirs["llama"], **kw)
    graphs = llm.engine.runner.graphs = _EagerGraphs(llm.engine.runner, max_batch=6)
    got = llm.generate(prompts, sp, loras)
    assert any(shape.query_len == 4 and padded for shape, padded in graphs.shapes), graphs.shapes
    assert llm.engine.stats()["spec_accepted_tokens"] > 0
    for a, b in zip(expected, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_steps_padded_to_a_graph_shape_change_no_token(model_dirs, adapter_dirs, monkeypatch, arch):
    """Steps padded as their CUDA graph runs them (a decode graph: one-token padding
    sequences; a mixed graph: a padding sequence with no context, then empty sequences,
    also for decodes past the largest decode graph) give the outputs of unpadded steps:
    tokens, logprobs and prompt logprobs, with adapters, chunked prefill and sliding
    windows (gemma3). The capture itself runs in the GPU suite."""
    from loraplex.runner import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "MIXED_GRAPH_STEP", 16)
    prompts = random_prompts(8, (5, 45), seed=21)
    loras = _loras(adapter_dirs, arch, len(prompts))
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    kw = dict(dtype="float32", max_num_batched_tokens=64, enforce_eager=True)
    expected = make_llm(model_dirs[arch], **kw).generate(prompts, sp, loras)
    llm = make_llm(model_dirs[arch], **kw)
    graphs = llm.engine.runner.graphs = _EagerGraphs(llm.engine.runner, max_batch=6)
    got = llm.generate(prompts, sp, loras)
    kinds = {(shape.decode, padded) for shape, padded in graphs.shapes}
    assert kinds >= {(True, 0), (False, 1)}, kinds
    assert any(not s.decode and s.seqs > 1 and p == 1 for s, p in graphs.shapes)
    tol = batch_tolerance()
    for a, b, p in zip(expected, got, prompts):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys()
            assert max(abs(x[t].logprob - y[t].logprob) for t in x) <= tol
        da = torch.tensor([x[t].logprob for x, t in zip(a.prompt_logprobs[1:], p[1:])])
        db = torch.tensor([x[t].logprob for x, t in zip(b.prompt_logprobs[1:], p[1:])])
        assert (da - db).abs().max().item() <= tol


def test_graph_shape_for_each_step():
    """Decode steps get the smallest decode graph that holds them, steps of chunks no
    longer than a short-chunk graph's (speculative verification) the smallest of those
    holding their tokens, other steps the mixed graph of their token count rounded up to
    64, holding max_num_seqs + 1 sequences; a mixed graph never stands for a decode one,
    even at equal sizes."""
    from types import SimpleNamespace

    from loraplex.runner.batch_meta import GraphShape
    from loraplex.runner.cuda_graphs import StepGraphs

    graphs = StepGraphs(model=None, inputs=SimpleNamespace(mixed_graph_seqs=64), max_batch=63,
                        max_tokens=1000, with_lora=False, short_chunks=(5, 127))
    assert graphs.decode_sizes == [1, 2, 4, 8, 16, 32, 48, 63]
    assert graphs.short_sizes == [2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 127]
    assert graphs.mixed_sizes[:2] == [64, 128] and graphs.mixed_sizes[-2:] == [960, 1000]
    assert graphs.shape_for(5, 5, 1) == GraphShape(8, 8, 1)
    assert graphs.shape_for(64, 3, 40) == GraphShape(64, 64, None)
    assert graphs.shape_for(64, 64, 1) is None  # 64 decodes: no decode graph, no padding sequence
    assert graphs.shape_for(63, 63, 1) == GraphShape(63, 63, 1)
    assert graphs.shape_for(65, 40, 30) == GraphShape(128, 64, None)
    assert graphs.shape_for(1001, 40, 30) is None  # past the largest: eager
    assert graphs.shape_for(9, 3, 5) == GraphShape(16, 16, 5)  # verification: up to k + 1 tokens
    assert graphs.shape_for(120, 40, 4) == GraphShape(127, 127, 5)
    assert graphs.shape_for(9, 3, 6) == GraphShape(64, 64, None)  # a longer chunk: mixed
    assert graphs.shape_for(128, 40, 5) == GraphShape(128, 64, None)  # past the largest short graph
