"""Tensor parallelism: an engine split across 2 and 4 ranks (gloo processes on CPU, GPUs
with NCCL) gives the single-process engine's prompt logprobs and greedy tokens, with
adapters on every projection and expert mixed with base rows; and what cannot split is
refused at startup, naming it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import (
    ADAPTERS,
    BOS,
    DEVICE,
    DTYPE,
    EOS,
    VOCAB,
    assert_same_greedy_tokens,
    batch_tolerance,
    build_tiny_model,
    make_llm,
    make_peft_adapter,
    random_prompts,
)
from test_moe import _per_expert_adapter

from loraplex import LoRARequest, SamplingParams
from loraplex.bench.synthetic import write_random_model
from loraplex.errors import AdapterInvalid, UnsupportedModel
from loraplex.runner.tensor_parallel import WORKER_LOST_STATUS

# GPUs: as many ranks as there are GPUs for (a machine with one GPU runs none of these).
SIZES = [2, 4] if DEVICE == "cpu" else [n for n in (2, 4) if n <= torch.cuda.device_count()]
# logprobs: bf16 runs may part at a near-tie, where both picks must be among the top 5.
SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0, logprobs=5)


def _run(model_dir, prompts, loras, size, sp=SP, check=None, **kwargs):
    """The outputs of an engine of `size` ranks; check(engine) before it closes."""
    llm = make_llm(model_dir, tensor_parallel_size=size, **kwargs)
    try:
        outs = llm.generate(prompts, sp, loras)
        if check is not None:
            check(llm.engine)
        return outs
    finally:
        llm.close()


def _assert_same(got, want, prompts):
    """Same prompt logprobs (float32: to summation order) and greedy tokens."""
    tol = batch_tolerance() if DTYPE == "float32" else 0.1
    for g, w, p in zip(got, want, prompts):
        lg = torch.tensor([x[t].logprob for x, t in zip(g.prompt_logprobs[1:], p[1:])])
        lw = torch.tensor([x[t].logprob for x, t in zip(w.prompt_logprobs[1:], p[1:])])
        if DTYPE == "float32":
            torch.testing.assert_close(lg, lw, atol=tol, rtol=0)
        else:  # a near-tie rounds differently: the median
            assert (lg - lw).abs().median() <= tol
        assert_same_greedy_tokens(g.outputs[0], w.outputs[0])


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """Llama (4 query heads, 2 KV heads: split by 2, replicated by 4) and Qwen2 (q/k/v
    biases, tied embeddings), with two adapters each."""
    root = tmp_path_factory.mktemp("tp-dense")
    out = {}
    for arch in ("llama", "qwen2"):
        model_dir = build_tiny_model(root / arch, arch)
        names = ("all7-r8", "mlp-o-r16-patterns")
        out[arch] = (model_dir, [make_peft_adapter(model_dir, root / f"{arch}-{n}", seed=i, **ADAPTERS[n])
                                 for i, n in enumerate(names)])
    return out


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_dense_matches_one_process(dense, arch, size):
    model_dir, adapters = dense[arch]
    prompts = random_prompts(6, (5, 40), seed=3)
    loras = [LoRARequest(f"a{i}", i + 1, str(adapters[i])) if i < 2 else None for i in (0, 1, 2, 0, 1, 2)]
    want = _run(model_dir, prompts, loras, 1)
    _assert_same(_run(model_dir, prompts, loras, size), want, prompts)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """Tiny Qwen3-MoE (a dense layer between sparse ones), an adapter on attention,
    router and every expert (PEFT's fused layout) and one in per-expert keys."""
    import transformers

    root = tmp_path_factory.mktemp("tp-moe")
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
        max_position_embeddings=512, bos_token_id=BOS, eos_token_id=EOS, initializer_range=0.08)
    model_dir = write_random_model(root / "qwen3moe", cfg, 0, None)
    fused = make_peft_adapter(model_dir, root / "fused", seed=11, r=4, lora_alpha=8,
                              target_modules=["q_proj", "o_proj", "gate", "down_proj"],
                              target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    per_expert, _ = _per_expert_adapter(model_dir, root)
    return model_dir, [fused, per_expert]


@pytest.mark.parametrize("size", SIZES)
def test_moe_with_expert_adapters_matches_one_process(moe, size):
    model_dir, adapters = moe
    prompts = random_prompts(6, (5, 30), seed=5)
    loras = [LoRARequest("fused", 1, str(adapters[0])), None, LoRARequest("experts", 2, str(adapters[1]))] * 2
    want = _run(model_dir, prompts, loras, 1)
    _assert_same(_run(model_dir, prompts, loras, size), want, prompts)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("variant", ["q_proj", "v3"])
def test_latent_attention_split_by_heads(variant, size, tmp_path):
    """DeepSeek: query heads, their kv_b_proj rows and o_proj columns split, the latent
    projections and cache whole on every rank; shared experts split like a dense MLP; an
    adapter on every projection and every routed expert, mixed with base rows."""
    from test_deepseek import VARIANTS, tiny_config

    model_dir = write_random_model(tmp_path / "model", tiny_config(**VARIANTS[variant]), 0)
    q = ["q_a_proj", "q_b_proj"] if VARIANTS[variant].get("q_lora_rank") else ["q_proj"]
    adapter = make_peft_adapter(
        model_dir, tmp_path / "adapter", seed=3, r=4, lora_alpha=8,
        target_modules=[*q, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    prompts = random_prompts(4, (5, 30), seed=6)
    loras = [LoRARequest("all", 1, str(adapter)), None] * 2
    want = _run(model_dir, prompts, loras, 1)
    _assert_same(_run(model_dir, prompts, loras, size), want, prompts)


def test_gpt_oss_sinks_and_biases_split(tmp_path):
    """gpt-oss: attention sinks split with their heads, q/k/v/o and expert biases (o's and
    down's added once, by rank 0), the sliding-window layers."""
    from test_gpt_oss import tiny_config

    model_dir = write_random_model(tmp_path / "gpt-oss", tiny_config(), 0)
    _randomise_biases_and_sinks(model_dir)
    prompts = random_prompts(3, (12, 30), seed=2)
    want = _run(model_dir, prompts, None, 1)
    _assert_same(_run(model_dir, prompts, None, SIZES[0]), want, prompts)


def _randomise_biases_and_sinks(model_dir):
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    gen = torch.Generator().manual_seed(0)
    for name, t in tensors.items():
        if name.endswith(("sinks", "bias")):
            tensors[name] = 0.3 * torch.randn(t.shape, generator=gen)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_sampling_speculation_and_dummy_weights(dense):
    """Seeded sampling and n-gram speculation give the one-process engine's tokens
    (rank 0 samples and verifies; the others take its ids and, with proposals made on
    the device on every rank, where each verified sequence goes on), and dummy weights
    are the same model split (each rank draws every matrix whole and keeps its part).
    bf16: the greedy runs to a near-tie; seeded draws then take other paths, so only
    their shape."""
    model_dir, adapters = dense["llama"]
    size = SIZES[0]
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [11, 12, 13, 11, 12, 13, 11, 12]]
    loras = [LoRARequest("a0", 1, str(adapters[0])), None]
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=8, n=2)
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'
    # Rows that return logprobs never speculate: the speculated run's rows do not (the
    # plain run's do, for bf16's near-ties).
    speculated = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    scored = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    for sp, got_sp, kwargs in ((seeded, seeded, {}), (scored, speculated, {"speculative_config": spec}),
                               (SP, SP, {"load_format": "dummy"})):
        plain = {k: v for k, v in kwargs.items() if k != "speculative_config"}
        want = _run(model_dir, prompts, loras, 1, sp, **plain)
        check = _proposed_on_device if plain != kwargs else None
        got = _run(model_dir, prompts, loras, size, got_sp, check=check, **kwargs)
        if DTYPE == "float32":
            assert _tokens(got) == _tokens(want)
        elif sp.temperature == 0:
            for g, w in zip(got, want):
                assert_same_greedy_tokens(g.outputs[0], w.outputs[0])
        else:
            assert [[len(t) for t in o] for o in _tokens(got)] == [[len(t) for t in o] for o in _tokens(want)]


def _proposed_on_device(engine) -> None:
    assert engine.scheduler.ngram_on_device and engine.runner.ngram is not None
    stats = engine.stats()
    assert stats["spec_draft_tokens"] > 0, stats


def _tokens(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_what_cannot_split_is_refused(dense, tmp_path):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=96,
                                   num_hidden_layers=1, num_attention_heads=3, num_key_value_heads=1,
                                   bos_token_id=BOS, eos_token_id=EOS)
    model_dir = write_random_model(tmp_path / "three-heads", cfg, 0, None)
    with pytest.raises(UnsupportedModel, match="num_attention_heads=3"):
        make_llm(model_dir, tensor_parallel_size=2)
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
            make_llm(dense["llama"][0], tensor_parallel_size=bad)
    with pytest.raises(ValueError, match="draft model"):
        make_llm(dense["llama"][0], tensor_parallel_size=2,
                 speculative_config={"model": str(dense["llama"][0]), "num_speculative_tokens": 2})


def test_dora_adapter_is_refused_and_others_still_served(dense, tmp_path):
    model_dir, adapters = dense["llama"]
    dora = make_peft_adapter(model_dir, tmp_path / "dora", seed=4, r=4, lora_alpha=8, use_dora=True,
                             target_modules=["q_proj", "v_proj"])
    llm = make_llm(model_dir, tensor_parallel_size=SIZES[0])
    try:
        with pytest.raises(AdapterInvalid, match="DoRA adapters are not served with tensor parallelism"):
            llm.generate([[5, 6, 7]], SP, LoRARequest("dora", 9, str(dora)))
        out = llm.generate([[5, 6, 7]], SP, LoRARequest("a0", 1, str(adapters[0])))
        assert len(out[0].outputs[0].token_ids) == SP.max_tokens
    finally:
        llm.close()


def test_served_over_http_like_one_process(chat_model):
    """`loraplex serve --tensor-parallel-size N` through the real server and OpenAI
    client: the same chat answer and logprobs as one process; the server's shutdown
    stops the workers."""
    from serving import client, running, serve_args

    answers = {}
    for size in (1, SIZES[0]):
        serving = running(serve_args(chat_model, "--served-model-name", "tiny",
                                     "--tensor-parallel-size", str(size)))
        server = next(serving)
        try:
            chat = client(server).chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "t5 t6 t7"}], max_tokens=6,
                temperature=0, logprobs=True)
            answers[size] = [(t.token, t.logprob) for t in chat.choices[0].logprobs.content]
        finally:
            next(serving, None)
        runner = server.engine.engine.runner
        assert size == 1 or all(p.poll() is not None for p in runner._procs)
    got, want = answers[SIZES[0]], answers[1]
    if DTYPE == "float32":
        assert [t for t, _ in got] == [t for t, _ in want]
        assert max(abs(a - b) for (_, a), (_, b) in zip(got, want)) <= batch_tolerance()
    else:  # bf16 may part at a near-tie later on
        assert got[0][0] == want[0][0] and abs(got[0][1] - want[0][1]) <= 0.1


def test_a_lost_worker_ends_the_process_not_hangs_it(dense, tmp_path):
    """A worker that dies would leave the leader waiting in its next collective: the
    process ends instead, with its own status and a line naming the rank."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "lose_a_worker.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from conftest import make_llm
        from loraplex import SamplingParams
        llm = make_llm({str(dense["llama"][0])!r}, tensor_parallel_size=2)
        os.kill(llm.engine.runner._procs[0].pid, signal.SIGKILL)
        while True:
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == WORKER_LOST_STATUS, done.stderr[-2000:]
    assert "tensor-parallel rank 1 exited" in done.stderr


def test_a_checkpoint_every_rank_fails_on_raises_the_leaders_error(dense, tmp_path):
    """A model directory without weights: LLM() raises the loader's error (the workers
    stop with it), and a tensor-parallel engine starts after it in the same process."""
    import shutil

    from loraplex.errors import ModelLoadError

    empty = tmp_path / "no-weights"
    shutil.copytree(dense["llama"][0], empty)
    for f in empty.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        make_llm(empty, tensor_parallel_size=SIZES[0])
    _run(dense["llama"][0], [[5, 6, 7]], None, SIZES[0])
