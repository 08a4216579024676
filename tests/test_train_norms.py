"""The fused training RMSNorm (train/norms.py): the Triton kernels (the interpreter on CPU)
against the plain-torch oracle in the three roundings, forward and dx; the oracle against
every transformers class it stands for, bit for bit; and install_fused_norms on tiny
LoRA-frozen models: the unpatched loss and gradients, the same state_dict."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from conftest import _COMMON, ARCHS, DEVICE, VOCAB

from loraplex import ops
from loraplex.ops.reference import elementwise as ref
from loraplex.train.lora import LoRASpec, default_targets, inject_lora, lora_parameters
from loraplex.train.norms import NORM_CLASSES, FusedRMSNorm, install_fused_norms, is_fused

MODES = ("llama", "fp32_weight", "unit_offset")
# transformers module of each class install_fused_norms knows
CLASS_MODULES = {
    "LlamaRMSNorm": "llama", "Qwen2RMSNorm": "qwen2", "Qwen3RMSNorm": "qwen3", "Qwen3MoeRMSNorm": "qwen3_moe",
    "MistralRMSNorm": "mistral", "MixtralRMSNorm": "mixtral", "DeepseekV2RMSNorm": "deepseek_v2",
    "DeepseekV3RMSNorm": "deepseek_v3", "GptOssRMSNorm": "gpt_oss", "GemmaRMSNorm": "gemma",
    "Gemma2RMSNorm": "gemma2", "Gemma3RMSNorm": "gemma3",
}


def _hf_class(name: str):
    package = CLASS_MODULES[name]
    return getattr(importlib.import_module(f"transformers.models.{package}.modeling_{package}"), name)


def _x(shape, kind, gen):
    """kind "fp32", "bf16-values" (bf16-representable, computed in float32) or "bf16"."""
    shape, transpose, sliced = shape
    full = (*shape[:-1], shape[-1] + 8) if sliced else shape
    x = torch.randn(full, generator=gen) * 3
    if kind != "fp32":
        x = x.bfloat16()
    x = x.to(DEVICE, torch.bfloat16 if kind == "bf16" else torch.float32)
    if sliced:  # a slice of wider rows (DeepSeek's kv_a_layernorm: a split of kv_a_proj's output)
        x = x[..., : shape[-1]]
    return x.transpose(1, 2) if transpose else x  # Gemma 3: q/k norm of [B, H, S, D] heads


SHAPES = {  # (shape, transposed, sliced)
    "rows-40": ((7, 40), False, False),  # width not a power of two, rows not a multiple of a block
    "qk-heads": ((2, 3, 5, 16), False, False),  # Qwen3's q/k norm: [B, S, H, D]
    "qk-heads-transposed": ((2, 5, 3, 16), True, False),
    "sliced": ((3, 4, 24), False, True),
    "wide": ((3, 1100), False, False),  # one row a program
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind", ["fp32", "bf16-values", "bf16"])
def test_kernels_match_oracle(mode, shape, kind):
    pytest.importorskip("triton")
    import loraplex.ops.triton as kernel

    gen = torch.Generator().manual_seed(len(shape) + MODES.index(mode))
    x = _x(SHAPES[shape], kind, gen)
    n = x.shape[-1]
    w = (torch.randn(n, generator=gen) * 0.5 + (0.0 if mode == "unit_offset" else 1.0)).to(DEVICE, x.dtype)
    g = (torch.randn(x.shape, generator=gen)).to(DEVICE, x.dtype)
    eps = 1e-5
    y, rstd = kernel.rms_norm_train(x, w, eps, mode)
    want, want_rstd = ref.rms_norm_train(x, w, eps, mode)
    assert y.shape == x.shape and y.dtype == want.dtype and rstd.shape == x.shape[:-1]
    assert rstd.dtype == torch.float32
    torch.testing.assert_close(rstd, want_rstd, rtol=1e-6, atol=0)
    # float32: the row sums' order alone differs; bf16: the same bits, but for a rare
    # rounding flipped by that (one unit in the last place)
    tol = dict(rtol=1e-6, atol=1e-6) if x.dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(y, want, **tol)
    if x.dtype == torch.bfloat16:
        assert (y != want).float().mean() <= 0.01
    dx = kernel.rms_norm_backward(g, x, rstd, w, mode)
    want_dx = ref.rms_norm_backward(g, x, want_rstd, w, mode)
    assert dx.shape == x.shape and dx.dtype == x.dtype
    scale = want_dx.abs().max().item()
    fp32 = x.dtype == torch.float32
    tol = dict(rtol=1e-5, atol=1e-6 * scale) if fp32 else dict(rtol=2e-2, atol=1e-2 * scale)
    torch.testing.assert_close(dx, want_dx, **tol)


@pytest.mark.parametrize("mode", MODES)
def test_oracle_backward_is_autograd_of_its_forward(mode):
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(2, 3, 5, 24, generator=gen) * 2).requires_grad_()
    w = torch.randn(24, generator=gen) * 0.5 + 1
    g = torch.randn(2, 3, 5, 24, generator=gen)
    y, rstd = ref.rms_norm_train(x, w, 1e-6, mode)
    y.backward(g)
    dx = ref.rms_norm_backward(g, x.detach(), rstd.detach(), w, mode)
    torch.testing.assert_close(dx, x.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(NORM_CLASSES))
@pytest.mark.parametrize("dtype, w_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                            (torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
def test_fused_forward_is_the_classes_forward(name, dtype, w_dtype):
    """The oracle is each transformers class's forward bit for bit (its dtype too: Llama's
    promotes a float32 weight times bf16 x to float32); the fused module's backward is
    autograd's of the class's forward (float32)."""
    cls = _hf_class(name)
    mode, eps_attr = NORM_CLASSES[name]
    gen = torch.Generator().manual_seed(3)
    norm = cls(40, eps=1e-5).requires_grad_(False)
    assert getattr(norm, eps_attr) == 1e-5
    with torch.no_grad():
        norm.weight.copy_(torch.randn(40, generator=gen) * 0.5 + (mode != "unit_offset"))
    norm.to(w_dtype)
    x = (torch.randn(6, 40, generator=gen) * 3).to(dtype)
    want = norm(x)
    got, _ = ref.rms_norm_train(x, norm.weight, 1e-5, mode)
    assert got.dtype == want.dtype and torch.equal(got, want)
    fused = copy.deepcopy(norm)
    assert install_fused_norms(fused) == 1 and is_fused(fused)
    y = fused(x)
    assert y.dtype == want.dtype and torch.equal(y, want)  # CPU: the oracle's backend
    if dtype == w_dtype == torch.float32:
        x = x.requires_grad_()
        g = torch.randn(6, 40, generator=gen)
        (dx_want,) = torch.autograd.grad(norm(x), x, g)
        y = fused(x)
        assert type(y.grad_fn).__name__ == "FusedRMSNormBackward"
        (dx,) = torch.autograd.grad(y, x, g)
        torch.testing.assert_close(dx, dx_want, rtol=1e-5, atol=1e-6)


def test_unfrozen_weights_keep_their_forward():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    frozen, trained = LlamaRMSNorm(8).requires_grad_(False), LlamaRMSNorm(8)
    model = torch.nn.ModuleList([frozen, trained, torch.nn.LayerNorm(8)])
    assert install_fused_norms(model) == 1 and is_fused(frozen) and not is_fused(trained)
    assert install_fused_norms(model) == 0  # already fused
    x = torch.randn(3, 8, requires_grad=True)
    frozen.weight.requires_grad_(True)  # unfrozen after: the class's forward again, with a weight grad
    frozen(x).sum().backward()
    assert frozen.weight.grad is not None
    with pytest.raises(ValueError, match="frozen"):
        FusedRMSNorm.apply(x, frozen.weight, 1e-6, "llama")
    del frozen.forward  # transformers' own again
    assert not is_fused(frozen)


MOE = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
           max_position_embeddings=128, initializer_range=0.08, num_hidden_layers=2)


def _config(arch: str):
    import transformers

    if arch in ARCHS:
        cls_name, extra = ARCHS[arch]
        return getattr(transformers, cls_name)(**{**_COMMON, **extra})
    if arch == "qwen3moe":
        return transformers.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=32, head_dim=32,
                                           num_experts=4, num_experts_per_tok=2, **MOE)
    if arch == "gpt_oss":
        return transformers.GptOssConfig(intermediate_size=32, head_dim=16, num_local_experts=4,
                                         num_experts_per_tok=2, sliding_window=8, **MOE)
    # DeepSeek V2: q_a_layernorm and kv_a_layernorm (over a split of kv_a_proj's output)
    return transformers.DeepseekV2Config(
        intermediate_size=96, moe_intermediate_size=32, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, **{**MOE, "num_key_value_heads": 4})


# arch -> norms per decoder layer (+ the final norm)
NORMS_PER_LAYER = {"llama": 2, "qwen3": 4, "gemma3": 6, "qwen3moe": 4, "gpt_oss": 2, "deepseek_v2": 4}


def _model(arch: str):
    """A tiny random model in float32, every norm weight random, LoRA (random A and B) on
    its default targets, the base frozen."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(arch), dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ in NORM_CLASSES:
                offset = 0.0 if NORM_CLASSES[type(m).__name__][0] == "unit_offset" else 1.0
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen) * 0.3 + offset)
        wrapped = inject_lora(model, LoRASpec(4, 8, default_targets(model)))
        for p in lora_parameters(wrapped):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.to(DEVICE).train(), wrapped


def _loss_and_grads(model, wrapped, checkpointing: bool):
    if checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, VOCAB, (2, 13), generator=gen).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0  # right padding
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    labels = ids.masked_fill(mask == 0, -100)
    loss = model(inputs_embeds=embeds, attention_mask=mask, labels=labels).loss
    loss.backward()
    grads = {"inputs_embeds": embeds.grad}
    grads.update({f"{path}.{n}": p.grad for path, m in sorted(wrapped.items())
                  for n, p in m.named_parameters() if "base_layer" not in n})
    return loss.item(), grads


@pytest.mark.parametrize("arch", list(NORMS_PER_LAYER))
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_install_fused_norms_keeps_loss_and_grads(arch, backend, monkeypatch):
    """The fused norms on a LoRA model with its base frozen: the same loss, input-embedding
    and LoRA gradients as transformers' own norms (float32), every norm fused and run
    backward once, the state_dict untouched; Triton's kernels under the interpreter."""
    if backend == "triton":
        pytest.importorskip("triton")
        kernel = importlib.import_module("loraplex.ops.triton")
        monkeypatch.setattr(ops, "rms_norm_train", kernel.rms_norm_train)
        monkeypatch.setattr(ops, "rms_norm_backward", kernel.rms_norm_backward)
    backward_calls = []
    rms_norm_backward = ops.rms_norm_backward

    def counted(*args):
        backward_calls.append(args[1].shape)
        return rms_norm_backward(*args)

    monkeypatch.setattr(ops, "rms_norm_backward", counted)
    checkpointing = arch in ("qwen3", "gemma3")  # recomputed layers run the fused norm again
    model, wrapped = _model(arch)
    reference = copy.deepcopy(model)
    ref_wrapped = {path: reference.get_submodule(path) for path in wrapped}
    state = model.state_dict()

    expected = NORMS_PER_LAYER[arch] * model.config.num_hidden_layers + 1
    assert install_fused_norms(model) == expected
    assert all(is_fused(m) for m in model.modules() if type(m).__name__ in NORM_CLASSES)
    assert not any(is_fused(m) for m in reference.modules())
    after = model.state_dict()
    assert list(after) == list(state)
    assert all(after[k] is state[k] or torch.equal(after[k], state[k]) for k in state)

    loss, grads = _loss_and_grads(model, wrapped, checkpointing)
    assert len(backward_calls) == expected  # every norm is on the loss's path
    want_loss, want = _loss_and_grads(reference, ref_wrapped, checkpointing)
    assert len(backward_calls) == expected  # the unpatched model calls none
    assert abs(loss - want_loss) <= 1e-6 * max(1.0, abs(want_loss))
    assert set(grads) == set(want) and len(grads) > 1
    for key, g in grads.items():
        assert want[key].abs().max() > 0, key
        scale = want[key].abs().max().item()
        torch.testing.assert_close(g, want[key], rtol=1e-4, atol=1e-5 * scale, msg=key)
