"""The fused training RoPE (train/rope.py): the Triton kernels (the interpreter on CPU)
against the plain-torch oracle, forward and backward, in any layout; the oracle against
transformers' apply_rotary_pos_emb and its backward against autograd; install_fused_rope
on tiny LoRA models: the unpatched loss and gradients, only the standard rotations
patched, and transformers' own function everywhere outside the hooked modules."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from conftest import DEVICE
from test_train_norms import _loss_and_grads, _model

from loraplex import ops
from loraplex.ops.reference import elementwise as ref
from loraplex.train import rope
from loraplex.train.rope import install_fused_rope

SHAPES = {  # name -> (x shape [B, H, S, D], transposed from [B, S, H, D], cos batch)
    "bhsd": ((2, 3, 5, 16), False, 2),
    "bshd-view": ((2, 3, 5, 16), True, 1),  # q = proj(x).view(B, S, H, D).transpose(1, 2)
    "odd-half": ((1, 2, 7, 12), True, 1),  # D / 2 not a power of two
    "long": ((1, 1, 150, 8), False, 1),  # several position blocks
}


def _inputs(name, dtype, gen):
    (b, h, s, d), transposed, cb = SHAPES[name]
    x = torch.randn(b, s, h, d, generator=gen).transpose(1, 2) if transposed else torch.randn(b, h, s, d,
                                                                                              generator=gen)
    angles = torch.randn(cb, s, d // 2, generator=gen) * 3
    cos, sin = (torch.cat((f(angles), f(angles)), -1) for f in (torch.cos, torch.sin))
    g = torch.randn(x.shape, generator=gen)
    return (t.to(DEVICE, dtype) for t in (x, cos, sin, g))


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_match_oracle(name, dtype):
    pytest.importorskip("triton")
    import loraplex.ops.triton as kernel

    x, cos, sin, g = _inputs(name, dtype, torch.Generator().manual_seed(len(name)))
    for fn, want_fn, arg in ((kernel.rope_train, ref.rope_train, x),
                             (kernel.rope_train_backward, ref.rope_train_backward, g)):
        got, want = fn(arg, cos, sin), want_fn(arg, cos, sin)
        assert got.shape == arg.shape and got.dtype == dtype and got.stride() == arg.stride()
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        else:  # float32 arithmetic rounded once: the same bits but for a rare tie
            torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-2)
            assert (got != want).float().mean() <= 0.01


def test_oracle_is_transformers_and_its_backward_is_autograd():
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 5, 4, 16, generator=gen, dtype=torch.float64).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 2, 5, 16, generator=gen, dtype=torch.float64)
    angles = torch.randn(2, 5, 8, generator=gen, dtype=torch.float64)
    cos, sin = (torch.cat((f(angles), f(angles)), -1) for f in (torch.cos, torch.sin))
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(ref.rope_train(q, cos, sin), want_q, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ref.rope_train(k, cos, sin), want_k, rtol=1e-12, atol=1e-12)
    g = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    (dq,) = torch.autograd.grad(want_q, q, g)
    torch.testing.assert_close(ref.rope_train_backward(g, cos, sin), dq, rtol=1e-12, atol=1e-12)


# arch -> whether its attention modules are hooked (gpt-oss's half-width and DeepSeek's
# interleaved rotations are not the standard one: left to transformers)
HOOKED = {"llama": True, "qwen3": True, "gemma3": True, "qwen3moe": True, "gpt_oss": False,
          "deepseek_v2": False}


@pytest.mark.parametrize("arch", list(HOOKED))
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_install_fused_rope_keeps_loss_and_grads(arch, backend, monkeypatch):
    if backend == "triton":
        pytest.importorskip("triton")
        kernel = importlib.import_module("loraplex.ops.triton")
        monkeypatch.setattr(ops, "rope_train", kernel.rope_train)
        monkeypatch.setattr(ops, "rope_train_backward", kernel.rope_train_backward)
    calls = []
    forward, backward = ops.rope_train, ops.rope_train_backward
    monkeypatch.setattr(ops, "rope_train", lambda *a: calls.append("f") or forward(*a))
    monkeypatch.setattr(ops, "rope_train_backward", lambda *a: calls.append("b") or backward(*a))
    model, wrapped = _model(arch)
    reference = copy.deepcopy(model)  # before the hooks: transformers' own rotation
    ref_wrapped = {path: reference.get_submodule(path) for path in wrapped}
    hooked = HOOKED[arch] * model.config.num_hidden_layers  # one attention module a layer
    assert install_fused_rope(model) == hooked
    assert install_fused_rope(model) == 0  # once
    checkpointing = arch in ("qwen3", "gemma3")  # the recompute runs the hooks again
    loss, grads = _loss_and_grads(model, wrapped, checkpointing)
    per_layer = 2 * (1 + checkpointing)  # q and k forward (again in the recompute)
    assert calls.count("f") == per_layer * hooked and calls.count("b") == 2 * hooked
    calls.clear()
    want_loss, want = _loss_and_grads(reference, ref_wrapped, checkpointing)
    assert not calls  # a model not installed keeps transformers' function
    assert abs(loss - want_loss) <= 1e-6 * max(1.0, abs(want_loss))
    for key, g in want.items():
        scale = g.abs().max().item()
        torch.testing.assert_close(grads[key], g, rtol=1e-4, atol=1e-5 * scale, msg=key)
    with torch.no_grad():  # inference: transformers' own
        model(input_ids=torch.tensor([[3, 4, 5]], device=DEVICE))
    assert not calls


def test_non_standard_rotation_is_refused():
    assert rope._is_standard(lambda q, k, cos, sin: (q * cos, k * cos)) is False
    assert rope._is_standard(lambda q, k, cos, sin: (q, k)) is False
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    assert rope._is_standard(getattr(apply_rotary_pos_emb, "fused_from", apply_rotary_pos_emb))
