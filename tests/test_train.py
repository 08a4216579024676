"""`loraplex train`: LoRA training against transformers + PEFT (same loss, same LoRA
gradients, every LoRA tensor reached) for dense and MoE models, routing replay under
gradient checkpointing, the grouped expert GEMMs, labels, resume, and adapters trained by
loraplex served by loraplex as transformers + PEFT computes them."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import BOS, DEVICE, DTYPE, EOS, VOCAB, HFOracle, make_llm, random_prompts, tolerance
from safetensors.torch import load_file

from loraplex import LoRARequest, SamplingParams
from loraplex.bench.synthetic import write_random_model
from loraplex.entrypoints.cli import main as cli
from loraplex.train import data, expert_gemm, moe
from loraplex.train.lora import LoRAExperts, lora_parameters
from loraplex.train.routing import ReplayedRouter, in_backward
from loraplex.train.save import peft_tensors, save_adapter
from loraplex.train.trainer import (
    TrainConfig,
    accumulate,
    causal_lm_loss_sum,
    enable_checkpointing,
    packing_supported,
    prepare,
    train,
)

# Chat template of the word tokenizer: "t3" opens a user turn, "t4" an assistant turn,
# "t2" (EOS) ends a turn.
TEMPLATE = ("{% for m in messages %}{{ 't3 ' if m['role'] == 'user' else 't4 ' }}{{ m['content'] }} t2 "
            "{% endfor %}{% if add_generation_prompt %}t4 {% endif %}")
MOE = dict(max_position_embeddings=512, bos_token_id=BOS, eos_token_id=EOS, initializer_range=0.08,
           vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)


def _moe_config(arch: str):
    import transformers

    if arch == "qwen3moe":  # layer 1 dense (mlp_only_layers)
        return transformers.Qwen3MoeConfig(
            intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, head_dim=32, num_experts=8,
            num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], **MOE)
    if arch == "deepseek_v2":  # latent attention (q_a/q_b), a dense first layer, shared experts
        return transformers.DeepseekV2Config(
            intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, kv_lora_rank=32,
            q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
            n_shared_experts=2,
            num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=1.5,
            **{**MOE, "num_key_value_heads": 4})
    if arch == "deepseek_v3":  # sigmoid routing with a correction bias, in groups; rotary halves
        return transformers.DeepseekV3Config(
            intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, kv_lora_rank=32,
            q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
            n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
            rope_interleave=False, **{**MOE, "num_key_value_heads": 4})
    if arch == "mixtral":
        return transformers.MixtralConfig(intermediate_size=32, num_hidden_layers=2, num_local_experts=4,
                                          num_experts_per_tok=2, **MOE)
    return transformers.GptOssConfig(intermediate_size=32, num_hidden_layers=2, head_dim=16,
                                     num_local_experts=8, num_experts_per_tok=2, sliding_window=8, **MOE)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("train-moe")
    dirs = {a: write_random_model(root / a, _moe_config(a), 0)
            for a in ("qwen3moe", "mixtral", "gpt_oss", "deepseek_v2", "deepseek_v3")}
    tok = AutoTokenizer.from_pretrained(dirs["qwen3moe"])
    tok.chat_template = TEMPLATE
    tok.save_pretrained(dirs["qwen3moe"])
    return dirs


def _batch():
    """Two sequences of different length (right padding), loss on all but a prompt."""
    ids = random_prompts(2, (14, 22), seed=3)
    exs = [data.Example(x, [data.IGNORE] * 5 + x[5:]) for x in ids]
    return data.collate(exs, pad_id=0)


def _our_model(model_dir, **cfg):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    spec, wrapped = prepare(model, TrainConfig(str(model_dir), "", "", **{"rank": 4, "alpha": 8, **cfg}))
    with torch.no_grad():  # B starts at zero: make every factor matter
        gen = torch.Generator().manual_seed(1)
        for p in lora_parameters(wrapped):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.train(), spec, wrapped


def _loss_and_grads(model, wrapped, batch):
    for p in lora_parameters(wrapped):
        p.grad = None
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    n = int((batch["labels"][:, 1:] != data.IGNORE).sum())
    loss = causal_lm_loss_sum(logits, batch["labels"]) / n
    loss.backward()
    return loss.item(), peft_tensors(wrapped, grads=True)


def assert_peft_agrees(model_dir, wrapped, spec, batch, loss, grads, adapter_dir) -> None:
    """Our adapter, saved and loaded by PEFT on the float32 model at model_dir, gives the
    same loss on `batch` and the same gradient of every LoRA tensor."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    save_adapter(adapter_dir, wrapped, spec, str(model_dir))
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                     adapter_dir, is_trainable=True).train()
    ref = peft(**batch)
    ref.loss.backward()
    ref_grads = {n.replace(".default", ""): p.grad for n, p in peft.named_parameters() if p.requires_grad}
    assert set(ref_grads) == set(grads)
    assert abs(ref.loss.item() - loss) <= 1e-5
    for key, g in grads.items():
        scale = ref_grads[key].abs().max().item()
        torch.testing.assert_close(g, ref_grads[key], rtol=1e-4, atol=1e-4 * scale)


def assert_checkpointing_keeps(model, wrapped, batch, loss, grads) -> None:
    """With gradient checkpointing enabled, the same loss and LoRA gradients."""
    enable_checkpointing(model)
    loss_gc, grads_gc = _loss_and_grads(model, wrapped, batch)
    assert loss_gc == loss
    for key, g in grads.items():
        torch.testing.assert_close(grads_gc[key], g, rtol=1e-6, atol=1e-7)


def _model_dir(arch, model_dirs, moe_dirs):
    return model_dirs[arch] if arch in model_dirs else moe_dirs[arch]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3", "qwen3moe", "mixtral", "gpt_oss",
                                  "deepseek_v2", "deepseek_v3"])
def test_loss_and_grads_match_peft(arch, model_dirs, moe_dirs, tmp_path):
    model_dir = _model_dir(arch, model_dirs, moe_dirs)
    model, spec, wrapped = _our_model(model_dir, moe_backend="loop")
    batch = _batch()
    loss, grads = _loss_and_grads(model, wrapped, batch)
    assert len(grads) == len(lora_parameters(wrapped))
    for key, g in grads.items():
        assert g.abs().max() > 0, key
    # Exactly the experts that a token the loss depends on went to get gradients: in the
    # last layer the tokens whose next token is labelled, before it every non-pad token.
    last = model.config.num_hidden_layers - 1
    loss_rows = torch.nn.functional.pad(batch["labels"][:, 1:] != data.IGNORE, (0, 1))
    for path, m in wrapped.items():
        if isinstance(m, LoRAExperts):
            block = model.get_submodule(path.rpartition(".")[0])
            router = getattr(block, "gate", None) or block.router
            live = loss_rows if f".{last}." in path else batch["attention_mask"].bool()
            routed = torch.bincount(router.recorded[live.flatten()].flatten(), minlength=m.num_experts) > 0
            assert routed.sum() >= m.num_experts // 2
            for p in lora_parameters({"m": m}):
                assert torch.equal(p.grad.flatten(1).abs().amax(1) > 0, routed)

    assert_peft_agrees(model_dir, wrapped, spec, batch, loss, grads, tmp_path / "ad")

    # Gradient checkpointing: the same gradients; MoE layers replay their routing.
    assert_checkpointing_keeps(model, wrapped, batch, loss, grads)
    routers = [m for m in model.modules() if isinstance(m, ReplayedRouter)]
    assert sum(r.replays for r in routers) == len(routers) == (0 if arch in model_dirs else len(
        [m for m in wrapped.values() if isinstance(m, LoRAExperts)]))


def test_routing_replay_keeps_experts_when_recompute_routes_otherwise(moe_dirs, monkeypatch):
    """A recompute whose top-k picks other experts (a GPU near a tie) still trains the
    layer the forward ran: gradients as without checkpointing. Without replay they differ."""
    model, _, wrapped = _our_model(moe_dirs["qwen3moe"])
    batch = _batch()
    _, want = _loss_and_grads(model, wrapped, batch)
    enable_checkpointing(model)
    topk = torch.topk

    def flaky_topk(x, k, **kw):
        res = topk(x, k, **kw)
        if not in_backward():
            return res
        return torch.return_types.topk((res.values, (res.indices + 1) % x.shape[-1]))

    monkeypatch.setattr(torch, "topk", flaky_topk)
    _, got = _loss_and_grads(model, wrapped, batch)
    for key, g in want.items():
        torch.testing.assert_close(got[key], g, rtol=1e-6, atol=1e-7)
    for block in [m for m in model.modules() if isinstance(getattr(m, "gate", None), ReplayedRouter)]:
        block.gate = block.gate.base  # transformers' router: no replay
    _, unreplayed = _loss_and_grads(model, wrapped, batch)
    assert any(not torch.allclose(unreplayed[k], g) for k, g in want.items())


@pytest.mark.skipif(expert_gemm._grouped_mm_op() is None, reason="this torch has no grouped_mm")
@pytest.mark.parametrize("rank", [4, 3])  # rank 3 fp32 rows are not 16-byte aligned: loop fallback
def test_expert_projection_backends(rank):
    """base + LoRA over expert-sorted rows, loop and grouped_mm, against per-expert
    autograd; the frozen base weight gets no gradient even when it would accept one."""
    gen = torch.Generator().manual_seed(0)
    t, k, e, d_in, d_out = 13, 2, 8, 64, 32
    idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    idx[idx == 5] = 6  # expert 5 gets no rows
    pairs = moe.sort_pairs(idx, e)
    tokens, groups = pairs.tokens, pairs.groups
    x0 = torch.randn(t, d_in, generator=gen)[tokens]
    w = torch.randn(e, d_out, d_in, generator=gen).transpose(1, 2).requires_grad_()
    a0, b0 = torch.randn(e, rank, d_in, generator=gen), torch.randn(e, d_out, rank, generator=gen)
    probe = torch.randn(len(tokens), d_out, generator=gen)
    results = []
    for backend in ("reference", "loop", "grouped_mm"):
        x, a, b = (z.clone().requires_grad_() for z in (x0, a0, b0))
        if backend == "reference":
            y = torch.cat([x[s:u] @ w[i].detach() + 0.5 * (x[s:u] @ a[i].T) @ b[i].T
                           for i, s, u in groups.blocks()])
        else:
            y = moe.ExpertProjection.apply(x, w, a.transpose(1, 2), b.transpose(1, 2), 0.5, groups, backend)
        (y * probe).sum().backward()
        assert w.grad is None
        results.append([y.detach(), x.grad, a.grad, b.grad])
    assert results[0][2][5].abs().max() == 0
    for got in results[1:]:
        for g, r in zip(got, results[0]):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("columns", [4096, 0])  # the token-level GEMM, and the gather it replaces
def test_token_rows_outer_is_the_gathered_outer(columns, monkeypatch):
    """A's gradient of a gathered projection from the token rows (x^T @ M, M holding each
    row's gxa at its token and expert) equals outer() over the gathered rows."""
    monkeypatch.setattr(moe, "TOKEN_OUTER_MAX_COLUMNS", columns)
    gen = torch.Generator().manual_seed(4)
    t, k, e, d, r = 11, 3, 6, 20, 4
    top = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    pairs = moe.sort_pairs(top, e)
    x, gxa = torch.randn(t, d, generator=gen), torch.randn(t * k, r, generator=gen)
    rows = moe.TokenRows(x, pairs)
    torch.testing.assert_close(rows.rows(), x[pairs.tokens])
    got = rows.outer(gxa, pairs.groups, "loop")
    want = expert_gemm.outer(x[pairs.tokens], gxa, pairs.groups, "loop")
    assert got.shape == want.shape == (e, d, r)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_gathered_projection_and_token_sum_match_autograd():
    """The projection that gathers its rows from [T, K] itself and the sort-based sum back
    onto tokens give what x[tokens] and index_add give, forward and backward."""
    gen = torch.Generator().manual_seed(1)
    t, k, e, d_in, d_out, rank = 13, 3, 8, 64, 32, 4
    idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    pairs = moe.sort_pairs(idx, e)
    assert torch.equal(pairs.order[pairs.inv], torch.arange(t * k))
    x0 = torch.randn(t, d_in, generator=gen)
    w = torch.randn(e, d_out, d_in, generator=gen).transpose(1, 2)
    a0, b0 = torch.randn(e, rank, d_in, generator=gen), torch.randn(e, d_out, rank, generator=gen)
    probe = torch.randn(t, d_out, generator=gen)
    results = []
    for fused in (False, True):
        x, a, b = (z.clone().requires_grad_() for z in (x0, a0, b0))
        if fused:
            y = moe.ExpertProjection.apply(x, w, a.transpose(1, 2), b.transpose(1, 2), 0.5,
                                           pairs.groups, "loop", pairs)
            out = moe.CombineByToken.apply(y, pairs)
        else:
            xs = x[pairs.tokens]
            y = torch.cat([xs[s:u] @ w[i] + 0.5 * (xs[s:u] @ a[i].T) @ b[i].T
                           for i, s, u in pairs.groups.blocks()])
            out = torch.zeros(t, d_out).index_add(0, pairs.tokens, y)
        (out * probe).sum().backward()
        results.append([out.detach(), x.grad, a.grad, b.grad])
    for g, r in zip(*results):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def test_grouped_mm_backend_matches_loop_in_a_model(moe_dirs):
    batch = _batch()
    grads = []
    for backend in ("loop", "grouped_mm"):
        model, _, wrapped = _our_model(moe_dirs["gpt_oss"], moe_backend=backend)
        grads.append(_loss_and_grads(model, wrapped, batch))
    assert abs(grads[0][0] - grads[1][0]) < 1e-6
    for key, g in grads[0][1].items():
        torch.testing.assert_close(grads[1][1][key], g, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ["qwen3moe", "mixtral"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_folded_experts_match_unfolded_and_peft(arch, backend, moe_dirs, tmp_path, monkeypatch):
    """At rank 8 SwiGLU expert stacks are folded with their LoRA factors (train/moe.py,
    FoldedStack): the base parameter stays its values (a view of the folded stack), and
    the loss and LoRA gradients are those of the stacks kept apart and PEFT's, under
    checkpointing too; Triton's kernels (the interpreter on CPU) write the padded rows."""
    import functools
    import importlib

    from loraplex import ops
    from loraplex.train import trainer
    from loraplex.train.lora import inject_lora

    if backend == "triton":
        module = importlib.import_module("loraplex.ops.triton")
        monkeypatch.setattr(ops, "backend_for", lambda device: module)
    model_dir = moe_dirs[arch]
    batch = _batch()
    model, spec, wrapped = _our_model(model_dir, moe_backend="loop", rank=8, alpha=16)
    experts = [m for m in wrapped.values() if isinstance(m, LoRAExperts)]
    assert experts and all(m.fold_rank == 8 for m in experts)
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    for path, m in wrapped.items():
        if isinstance(m, LoRAExperts):
            for p in ("gate_up_proj", "down_proj"):
                w = getattr(m.base_layer, p)
                assert w.data_ptr() == getattr(m, f"{p}_folded").data_ptr()
                assert torch.equal(w, plain[f"{path}.{p}"])
    with_room = moe._with_room
    rows_in_place = []  # gate/up's backward finds its gradient in the wider rows GatedDown left
    monkeypatch.setattr(moe, "_with_room", lambda t, extra: (
        room := with_room(t, extra), rows_in_place.append(room is t._base))[0])
    loss, grads = _loss_and_grads(model, wrapped, batch)
    assert rows_in_place and all(rows_in_place)
    monkeypatch.setattr(trainer, "inject_lora", functools.partial(inject_lora, fold_experts=False))
    apart, _, apart_wrapped = _our_model(model_dir, moe_backend="loop", rank=8, alpha=16)
    assert all(m.fold_rank == 0 for m in apart_wrapped.values() if isinstance(m, LoRAExperts))
    want_loss, want = _loss_and_grads(apart, apart_wrapped, batch)
    assert abs(loss - want_loss) <= 1e-6
    # The folded stacks sum in another order: float32 reassociation, ~1e-7 absolute on
    # entries near zero (2e-6 of the largest; seen at 1e-6 with transformers 5.24).
    for key, g in want.items():
        torch.testing.assert_close(grads[key], g, rtol=1e-4, atol=1e-5 * g.abs().max().item(), msg=key)
    assert_peft_agrees(model_dir, wrapped, spec, batch, loss, grads, tmp_path / "ad")
    assert_checkpointing_keeps(model, wrapped, batch, loss, grads)


@pytest.mark.parametrize("arch", ["qwen3moe", "mixtral", "gpt_oss"])
def test_fused_training_kernels_match_eager(arch, moe_dirs, monkeypatch):
    """The Triton kernels a GPU trains with (gated activation x routing weight, sum onto
    tokens; Triton's interpreter on CPU) give the plain-torch loss and LoRA gradients."""
    import importlib

    from loraplex import ops

    experts = [m for m in _our_model(moe_dirs[arch])[2].values() if isinstance(m, LoRAExperts)]
    assert experts and all(m.silu_gate == (arch != "gpt_oss") for m in experts)
    batch = {k: v.to(DEVICE) for k, v in _batch().items()}  # float32, on the test device
    results = []
    for name in ("torch", "triton"):
        module = importlib.import_module(f"loraplex.ops.{'reference' if name == 'torch' else 'triton'}")
        monkeypatch.setattr(ops, "backend_for", lambda device, m=module: m)
        model, _, wrapped = _our_model(moe_dirs[arch], moe_backend="loop")
        results.append(_loss_and_grads(model.to(DEVICE), wrapped, batch))
    assert abs(results[0][0] - results[1][0]) < 1e-5
    for key, g in results[0][1].items():
        torch.testing.assert_close(results[1][1][key], g, rtol=1e-4, atol=1e-5 * g.abs().max().item())


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt_oss"])
def test_expert_functions_save_activations_where_checkpointing_sees_them(arch, moe_dirs):
    """The MoE autograd functions keep tensors only through save_for_backward: torch's
    checkpoint discards (and recomputes) exactly those, so a tensor held as a plain ctx
    attribute would outlive a checkpointed layer ([P, 3I] per layer: 29 GB at 16K tokens
    over Qwen3-30B-A3B's 48 layers)."""
    model, _, wrapped = _our_model(moe_dirs[arch], moe_backend="loop")
    batch = _batch()
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    ours = {"ExpertProjectionBackward", "GatedDownBackward", "CombineByTokenBackward"}
    seen, stack, found = set(), [logits.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        name = type(node).__name__
        if name in ours:
            found.add(name)
            held = {k for k, v in vars(node).items()
                    if isinstance(v, torch.Tensor) or (isinstance(v, (list, tuple)) and any(
                        isinstance(t, torch.Tensor) for t in v))}
            assert not held, f"{name} holds {held} outside save_for_backward"
        stack.extend(n for n, _ in node.next_functions)
    assert "ExpertProjectionBackward" in found
    assert ("GatedDownBackward" in found) == (arch == "qwen3moe")


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3moe", "deepseek_v2"])
def test_packed_batches_give_the_padded_loss_and_grads(arch, model_dirs, moe_dirs):
    """Examples packed into one row (attention bounded by the restarting positions; sliding
    windows, routing and latent attention included) train as the padded batch does."""
    model, _, wrapped = _our_model(_model_dir(arch, model_dirs, moe_dirs), moe_backend="loop")
    assert packing_supported(model)
    ids = random_prompts(3, (9, 23), seed=4)
    examples = [data.Example(x, [data.IGNORE] * 4 + x[4:]) for x in ids]
    results = []
    for batch in (data.collate(examples, pad_id=0), data.pack(examples)):
        for p in lora_parameters(wrapped):
            p.grad = None
        results.append((accumulate(model, [batch]), peft_tensors(wrapped, grads=True)))
        assert data.num_tokens(batch) == sum(map(len, ids))
    (padded, grads), (packed, packed_grads) = results
    assert abs(packed - padded) <= 1e-5
    for key, g in grads.items():
        torch.testing.assert_close(packed_grads[key], g, rtol=1e-4, atol=1e-4 * g.abs().max().item())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3", "qwen3moe", "gpt_oss", "deepseek_v2"])
def test_chunked_loss_is_the_full_logits_loss(arch, model_dirs, moe_dirs, monkeypatch):
    """The loss from hidden states in chunks (no [tokens, vocab] logits; chunks of 7 rows
    here, Gemma's logit soft-capping, tied embeddings) equals the loss of the model's own
    logits, and so do the LoRA gradients."""
    from loraplex.train import loss as chunked

    monkeypatch.setattr(chunked, "CHUNK_BYTES", 7 * 4 * VOCAB)  # 7 rows a chunk
    model, _, wrapped = _our_model(_model_dir(arch, model_dirs, moe_dirs), moe_backend="loop")
    batch = _batch()
    want, want_grads = _loss_and_grads(model, wrapped, batch)  # the model's logits
    for p in lora_parameters(wrapped):
        p.grad = None
    assert abs(accumulate(model, [batch]) - want) <= 1e-5
    for key, g in peft_tensors(wrapped, grads=True).items():
        scale = want_grads[key].abs().max().item()
        torch.testing.assert_close(g, want_grads[key], rtol=1e-4, atol=1e-4 * scale)


def test_packing_is_off_where_attention_crosses_examples(moe_dirs, tmp_path):
    """transformers' gpt-oss lets packed examples attend across their boundary: the
    default leaves packing off there, and asking for it fails before any step."""
    model, _, _ = _our_model(moe_dirs["gpt_oss"])
    assert not packing_supported(model)
    examples = tmp_path / "data.jsonl"
    record = json.dumps({"prompt": "t5 t6", "completion": " t7 t8"})
    examples.write_text("".join(record + "\n" for _ in range(4)))
    cfg = dict(model=str(moe_dirs["gpt_oss"]), data=str(examples), rank=2, max_steps=1, progress=False,
               moe_backend="loop")
    train(TrainConfig(out=str(tmp_path / "auto"), **cfg))
    assert (tmp_path / "auto" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "auto" / "loss.png").stat().st_size > 0  # the loss curve beside the adapter
    with pytest.raises(ValueError, match="--no-packing"):
        train(TrainConfig(out=str(tmp_path / "forced"), packing=True, **cfg))


def test_labels_mask_everything_but_the_answer(moe_dirs):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(moe_dirs["qwen3moe"])
    ex = data.encode(tok, {"prompt": "t5 t6 t7", "completion": "t8 t9"})
    assert ex.input_ids == [5, 6, 7, 8, 9, EOS] and ex.labels == [-100, -100, -100, 8, 9, EOS]
    messages = [{"role": "user", "content": "t10 t11"}, {"role": "assistant", "content": "t12"},
                {"role": "user", "content": "t13"}, {"role": "assistant", "content": "t14 t15"}]
    ex = data.encode(tok, {"messages": messages})
    assert ex.input_ids == [3, 10, 11, 2, 4, 12, 2, 3, 13, 2, 4, 14, 15, 2]
    # Each assistant turn: its content and the end of turn; never its "t4" header.
    assert ex.labels == [-100] * 5 + [12, 2] + [-100] * 4 + [14, 15, 2]
    # A template whose turns end without EOS (a plain word here, a newline in the default
    # model's): the last assistant turn also trains EOS, so the model learns to stop.
    tok.chat_template = "{% for m in messages %}{{ m.content }} t7 {% endfor %}"
    ex = data.encode(tok, {"messages": messages[:2]})
    assert ex.input_ids == [10, 11, 7, 12, 7, EOS] and ex.labels == [-100] * 3 + [12, 7, EOS]
    # A template that marks the last turn: earlier turns render otherwise once more follow.
    tok.chat_template = "{% for m in messages %}{% if loop.last %}t9 {% endif %}{{ m.content }} {% endfor %}"
    with pytest.raises(ValueError, match="one record per assistant turn"):
        data.encode(tok, {"messages": messages})


def test_targets_an_adapter_could_not_carry_are_refused(model_dirs, moe_dirs):
    from transformers import AutoModelForCausalLM

    cases = [(model_dirs["qwen3"], ["experts"], "match nothing"), (model_dirs["qwen3"], ["qkv"], "unknown"),
             # PEFT would load gate/up/down on a Qwen3-MoE as its experts (transformers 4 names)
             (moe_dirs["qwen3moe"], ["q_proj", "down_proj"], "PEFT reads them as its experts")]
    for model_dir, targets, match in cases:
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        with pytest.raises(ValueError, match=match):
            prepare(model, TrainConfig(str(model_dir), "", "", targets=targets))


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _memorize_records(seed: int, messages: bool):
    gen = torch.Generator().manual_seed(seed)
    words = [" ".join(f"t{i}" for i in torch.randint(5, VOCAB, (n,), generator=gen).tolist())
             for n in (4, 3) * 4]
    pairs = list(zip(words[::2], words[1::2]))
    if messages:
        return [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": c}]}
                for p, c in pairs]
    return [{"prompt": p, "completion": c} for p, c in pairs]


def _train(model_dir, data_path, out, *extra):
    args = ["train", "--model", str(model_dir), "--data", str(data_path), "--out", str(out), "--rank", "8",
            "--lr", "0.02", "--batch-size", "4", "--no-progress", *extra]
    assert cli(args) == 0
    return [json.loads(line)["loss"] for line in (out / "train_log.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("arch,messages", [("qwen3", False), ("qwen3moe", True), ("gpt_oss", False)])
def test_trained_adapter_serves_as_peft_computes_it(arch, messages, model_dirs, moe_dirs, tmp_path):
    model_dir = _model_dir(arch, model_dirs, moe_dirs)
    jsonl = _write_jsonl(tmp_path / "data.jsonl", _memorize_records(0, messages))
    losses = _train(model_dir, jsonl, tmp_path / "ad", "--epochs", "20", "--gradient-checkpointing",
                    "--device", DEVICE)  # on a GPU: bf16, grouped_mm experts
    # 4 records, one batch: the tiny random model's frozen head caps how low it can go.
    assert len(losses) == 20 and losses[-1] < 0.4 * losses[0]
    config = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    if arch == "qwen3moe":
        assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        assert config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
        keys = load_file(str(tmp_path / "ad" / "adapter_model.safetensors"))
        assert any("experts.base_layer.lora_B" in k for k in keys)

    prompts = random_prompts(3, (6, 20), seed=5)
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = make_llm(model_dir).generate(prompts, sp, LoRARequest("trained", 1, str(tmp_path / "ad")))
    oracle, base = HFOracle(model_dir, tmp_path / "ad"), HFOracle(model_dir)
    for p, out in zip(prompts, outs):
        got = torch.tensor([x[t].logprob for x, t in zip(out.prompt_logprobs[1:], p[1:])])
        want = oracle.prompt_logprobs(p)
        if DTYPE == "float32":
            torch.testing.assert_close(got, want, atol=tolerance(), rtol=0)
        elif (got - want).abs().median() > tolerance():
            # bf16 itself moved the answer: a router near a tie picks another expert once
            # rounded, and later tokens attend to the changed one (seen with gpt-oss: PEFT
            # in bf16 differs from float32 by up to 1.1 there). Then loraplex must agree
            # with transformers + PEFT computing in bf16 too.
            bf16 = HFOracle(model_dir, tmp_path / "ad", dtype=torch.bfloat16).prompt_logprobs(p)
            assert (bf16 - want).abs().max() > tolerance(), "bf16 alone does not explain the difference"
            assert (got - bf16).abs().median() <= tolerance()
        assert (want - base.prompt_logprobs(p)).abs().max() > 1e-2  # the adapter does something


def test_resume_continues_bit_identically(model_dirs, tmp_path):
    jsonl = _write_jsonl(tmp_path / "data.jsonl", _memorize_records(1, False) * 2)
    # 4 steps; on CPU (CUDA's index_add and atomics-based kernels need not repeat bit for bit)
    flags = ["--epochs", "2", "--batch-size", "2", "--grad-accum", "2", "--save-steps", "2",
             "--device", "cpu"]
    straight = _train(model_dirs["qwen3"], jsonl, tmp_path / "a", *flags)
    assert len(straight) == 4 and [p.name for p in (tmp_path / "a").glob("checkpoint-*")] == ["checkpoint-2"]
    shutil.copytree(tmp_path / "a" / "checkpoint-2", tmp_path / "b" / "checkpoint-2")
    resumed = _train(model_dirs["qwen3"], jsonl, tmp_path / "b", *flags, "--resume")
    assert resumed == straight[2:]  # steps 3 and 4, to the bit
    a = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "b" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
