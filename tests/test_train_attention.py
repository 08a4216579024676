"""Training's own attention (train/attention.py), packed rows of fixed shapes, the
sync-free loss, and the CUDA-graph micro-step (train/graphed.py) they exist for."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, random_prompts
from test_train import _moe_config, _our_model, _write_jsonl

from loraplex.bench.synthetic import write_random_model
from loraplex.train import attention, data
from loraplex.train.graphed import row_length
from loraplex.train.lora import lora_parameters
from loraplex.train.loss import chunked_loss_sum
from loraplex.train.trainer import TrainConfig, accumulate, packing_supported, train, training_attention

ARCHS = ["llama", "mistral", "qwen3", "gemma3", "qwen3moe", "deepseek_v2"]


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("attention-moe")
    return {a: write_random_model(root / a, _moe_config(a), 0)
            for a in ("qwen3moe", "deepseek_v2", "gpt_oss")}


def _dir(arch, model_dirs, moe_dirs):
    return model_dirs[arch] if arch in model_dirs else moe_dirs[arch]


def _logits(model, ids, **kw):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), use_cache=False, **kw).logits[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_attention_is_transformers_on_rows_and_on_each_packed_example(arch, model_dirs, moe_dirs):
    """Set to loraplex's attention, a model gives transformers' SDPA logits on a whole row
    (Mistral's and Gemma 3's sliding windows shorter than it, Gemma's query scale,
    DeepSeek's latent attention with values narrower than keys), and on a packed row each
    example's own logits: the boundaries are cu_seq_lens, with an empty trailing slot."""
    model, _, _ = _our_model(_dir(arch, model_dirs, moe_dirs), moe_backend="loop")
    ids = random_prompts(3, (9, 23), seed=5)
    row = [t for x in ids for t in x]
    want = _logits(model, row)
    alone = [_logits(model, x) for x in ids]
    assert model.config._attn_implementation != attention.NAME
    model.set_attn_implementation(attention.register())
    torch.testing.assert_close(_logits(model, row), want, rtol=1e-5, atol=1e-5)
    packed = data.pack([data.Example(x, x) for x in ids], bounds=True, slots=len(ids) + 1)
    assert packed["cu_seq_lens_q"].tolist()[-2:] == [len(row)] * 2
    inputs = {k: v for k, v in packed.items() if k not in ("labels", "input_ids", "tokens")}
    torch.testing.assert_close(_logits(model, row, **inputs), torch.cat(alone), rtol=1e-5, atol=1e-5)
    assert packing_supported(model)


def test_attention_refuses_what_it_does_not_bound(model_dirs):
    """transformers drops a padding mask before a custom attention sees it: the loss
    refuses a padded batch rather than let padding be attended to."""
    model, _, _ = _our_model(model_dirs["llama"])
    model.set_attn_implementation(attention.register())
    padded = data.collate([data.Example([5, 6, 7], [5, 6, 7]), data.Example([8, 9], [8, 9])], pad_id=0)
    with pytest.raises(ValueError, match="padded"):
        accumulate(model, [padded])


def test_training_attention_is_loraplex_for_packed_rows(model_dirs, moe_dirs):
    cpu = torch.device("cpu")
    assert training_attention(str(model_dirs["llama"]), cpu) == attention.NAME
    assert training_attention(str(model_dirs["llama"]), cpu, packing=False) is None  # padded: masks
    assert training_attention(str(moe_dirs["gpt_oss"]), cpu) is None  # sinks: not here


def test_pack_to_a_fixed_shape_trains_as_the_row_alone(model_dirs):
    """A row padded to a captured length with its boundaries in fixed slots gives the
    unpadded row's loss and LoRA gradients (the padding is an example of its own, with
    no labels), and counts only the examples' tokens."""
    model, _, wrapped = _our_model(model_dirs["qwen3"])
    model.set_attn_implementation(attention.register())
    ids = random_prompts(3, (9, 23), seed=4)
    examples = [data.Example(x, [data.IGNORE] * 4 + x[4:]) for x in ids]
    total = sum(map(len, ids))
    fixed = data.pack(examples, bounds=True, length=row_length(total), slots=5, pad_id=0)
    assert fixed["input_ids"].shape == (1, 256) and fixed["max_length_q"] == 256
    ends = torch.tensor(list(map(len, ids))).cumsum(0).tolist()
    assert fixed["cu_seq_lens_q"].tolist() == [0, *ends, 256, 256]
    assert data.num_tokens(fixed) == total and (fixed["labels"][0, total:] == data.IGNORE).all()
    results = []
    for batch in (data.pack(examples, bounds=True), fixed):
        for p in lora_parameters(wrapped):
            p.grad = None
        results.append((accumulate(model, [batch]), [p.grad.clone() for p in lora_parameters(wrapped)]))
    (loss, grads), (padded, padded_grads) = results
    assert abs(loss - padded) <= 1e-6
    for g, h in zip(grads, padded_grads, strict=True):
        torch.testing.assert_close(h, g, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="slots"):
        data.pack(examples, bounds=True, slots=2)


def test_row_lengths_are_few_and_waste_at_most_half():
    lengths = {row_length(n) for n in range(1, 20000)}
    assert sorted(lengths)[:6] == [256, 384, 512, 768, 1024, 1536]
    assert all(row_length(n) >= n and (n <= 256 or row_length(n) <= 1.5 * n) for n in range(1, 20000, 7))


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_sync_free_loss_is_the_loss(softcap):
    """The loss a CUDA graph takes (every row through the head, ignored rows' terms zeroed)
    equals the one that skips ignored rows, and so do the gradients."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 17, 8, generator=gen, dtype=torch.float64)
    head = torch.randn(40, 8, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 40, (2, 17), generator=gen)
    labels[0, :6] = data.IGNORE
    labels[1, 9:] = data.IGNORE
    out = []
    for sync_free in (False, True):
        h = hidden.clone().requires_grad_()
        loss = chunked_loss_sum(h, head, labels, softcap, chunk=5, sync_free=sync_free)
        loss.backward()
        out.append((loss.detach(), h.grad))
    torch.testing.assert_close(out[1][0], out[0][0])
    torch.testing.assert_close(out[1][1], out[0][1])


def test_train_packs_rows_bounded_by_its_attention(model_dirs, tmp_path):
    """`loraplex train` on CPU: packed rows through loraplex's attention (graphs are a GPU's),
    a finite loss; --cuda-graph where there is no GPU is refused before any step."""
    records = [{"prompt": f"t{5 + i} t6", "completion": f" t7 t{8 + i}"} for i in range(6)]
    cfg = dict(model=str(model_dirs["llama"]), data=str(_write_jsonl(tmp_path / "d.jsonl", records)), rank=2,
               max_steps=2, progress=False, batch_size=3)
    losses = train(TrainConfig(out=str(tmp_path / "a"), **cfg))
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="--cuda-graph needs a GPU"):
            train(TrainConfig(out=str(tmp_path / "b"), cuda_graph=True, **cfg))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("arch, checkpointing", [("qwen3", False), ("qwen3moe", True)])
def test_graphed_micro_steps_give_the_eager_gradients(arch, checkpointing, model_dirs, moe_dirs):
    """On a GPU: micro-steps replayed from CUDA graphs (two row lengths, one pool; the
    gradients of one copied out of the pool before the next replays) give the eager
    steps' loss and gradients, on capture and on later replays; an MoE model at rank 16
    (folded expert stacks, grouped GEMMs) with its layers recomputed in backward too."""
    from loraplex.train.lora import LoRAExperts
    from loraplex.train.trainer import enable_checkpointing, graphed_steps

    model, _, wrapped = _our_model(_dir(arch, model_dirs, moe_dirs), rank=16, alpha=32)
    model.to("cuda", torch.bfloat16).set_attn_implementation(attention.register())  # flash: bf16
    experts = [m for m in wrapped.values() if isinstance(m, LoRAExperts)]
    assert (arch == "qwen3moe") == bool(experts) and all(m.fold_rank == 16 for m in experts)
    for m in experts:
        m.backend = "grouped_mm"  # resolved on the CPU the model was prepared on
    if checkpointing:
        enable_checkpointing(model, preserve_rng_state=False)
    params = lora_parameters(wrapped)
    for p in params:  # LoRA factors stay float32
        p.data = p.data.float()
    rows = [random_prompts(3, (9, 23), seed=s) for s in (1, 2)] + [random_prompts(9, (40, 60), seed=3)]
    batches = [data.pack([data.Example(x, x) for x in ids], bounds=True,
                         length=row_length(sum(map(len, ids))), slots=10) for ids in rows]
    for p in params:
        p.grad = None
    want = accumulate(model, batches)
    grads = [p.grad.clone() for p in params]
    graphed = graphed_steps(model, params)
    for _ in range(2):  # captures, then replays only
        for p in params:
            p.grad = None
        got = accumulate(model, batches, graphed)
    assert len(graphed.steps) == 2 and not graphed.eager  # captured, no fallback
    graph_grads = [p.grad.clone() for p in params]
    assert abs(got - want) <= 1e-3 * abs(want)
    for g, h in zip(grads, graph_grads, strict=True):  # (flash's backward adds with atomics)
        assert (h - g).norm() <= 1e-2 * g.norm()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_steps_that_wait_for_the_host_run_eagerly(moe_dirs):
    """On a GPU: a step that reads the device from the host (the per-expert loop reads its
    row counts) cannot be captured: graphed_steps says so once and runs it eagerly, with
    the eager loss and gradients."""
    from loraplex.train.trainer import graphed_steps

    model, _, wrapped = _our_model(moe_dirs["qwen3moe"], moe_backend="loop")
    model.to("cuda", torch.bfloat16).set_attn_implementation(attention.register())
    params = lora_parameters(wrapped)
    for p in params:
        p.data = p.data.float()
    ids = random_prompts(3, (9, 23), seed=1)
    batches = [data.pack([data.Example(x, x) for x in ids], bounds=True,
                         length=row_length(sum(map(len, ids))), slots=4)]
    want = accumulate(model, batches)
    grads = [p.grad.clone() for p in params]
    graphed = graphed_steps(model, params)
    for p in params:
        p.grad = None
    got = accumulate(model, batches, graphed)
    assert graphed.eager and not graphed.steps
    assert abs(got - want) <= 1e-3 * abs(want)
    for g, p in zip(grads, params, strict=True):
        assert (p.grad - g).norm() <= 1e-2 * g.norm()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN's and flash's kernels need a GPU")
@pytest.mark.parametrize("case", ["row", "packed", "window", "packed_window", "narrow_values"])
def test_gpu_kernels_are_the_reference(case):
    """On a GPU in bf16, the kernels (cuDNN's causal SDPA for a row, flash's variable-length
    kernel for packed rows and windows; values narrower than keys padded for it) against
    the CPU reference in float32, forward and the gradients of q, k and v."""
    gen = torch.Generator().manual_seed(0)
    s, hq, hkv, d = 300, 8, 2, 64
    dv = 32 if case == "narrow_values" else d
    q, k = (torch.randn(1, h, s, d, generator=gen) for h in (hq, hkv))
    v, g = torch.randn(1, hkv, s, dv, generator=gen), torch.randn(1, s, hq, dv, generator=gen)
    kw = {}
    if "packed" in case:
        cu = torch.tensor([0, 70, 71, 200, 300, 300], dtype=torch.int32)
        kw = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=s, max_length_k=s)
    window = 50 if "window" in case else None
    outs = []
    for device, dtype in (("cpu", torch.float32), ("cuda", torch.bfloat16)):
        leaves = [t.to(device, dtype, copy=True).requires_grad_() for t in (q, k, v)]
        kws = {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in kw.items()}
        out = attention.attention_forward(None, *leaves, None, scaling=0.1, sliding_window=window, **kws)[0]
        out.backward(g.to(device, dtype))
        outs.append([t.float().cpu() for t in (out, *(x.grad for x in leaves))])
    for want, got in zip(*outs, strict=True):
        assert (got - want).norm() / want.norm() < 1e-2
