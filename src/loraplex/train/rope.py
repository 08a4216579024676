"""Fused rotary position embedding for LoRA training: one kernel each way.

transformers applies RoPE through a module-level `apply_rotary_pos_emb(q, k, cos, sin)`
in each modeling file: ~6 elementwise ops per tensor forward (x * cos, the halves sliced,
negated and concatenated, times sin, the sum) and as many backward. At 16K tokens of
Qwen3-30B-A3B's 32 query heads (H100) those passes took ~4 ms of a 2-layer step's 57.
`install_fused_rope` replaces that function, in each modeling module of the model whose
function computes the standard NeoX rotation (checked on a probe input, so interleaved,
half-width or partial variants such as DeepSeek's and gpt-oss's are left alone), with one
that runs `FusedRope`: ops.rope_train forward, ops.rope_train_backward backward, one
autograd node for q and k, nothing saved but cos and sin. It is the approach of Liger
Kernel and Unsloth, which patch the same function.

The replacement takes the fused path only inside the forward of a module
`install_fused_rope` hooked (the model's attention modules; a checkpointed layer's
recompute runs those hooks again), where a gradient will flow (grad mode on, q or k
requiring one) and the call is the standard one (4-d q/k, full-width cos/sin [B or 1, S,
D], unsqueeze_dim 1); everywhere else, another model of the same class included, it
calls transformers' own. Fused arithmetic is float32 rounded once, where transformers
rounds after each op: within bf16 rounding of it.
"""

from __future__ import annotations

import inspect
import sys
import threading
from collections.abc import Callable

import torch
from torch import nn

from loraplex import ops

NAME = "apply_rotary_pos_emb"
_inside = threading.local()  # .depth: hooked modules whose forward is running on this thread


class FusedRope(torch.autograd.Function):
    """(q, k) rotated by ops.rope_train; backward the transposed rotation."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return ops.rope_train(q, cos, sin), ops.rope_train(k, cos, sin)

    @staticmethod
    def backward(ctx, gq, gk):
        cos, sin = ctx.saved_tensors
        back = lambda g: None if g is None else ops.rope_train_backward(g, cos, sin)  # noqa: E731
        return back(gq), back(gk), None, None


def _standard_call(q, k, cos, sin) -> bool:
    return (q.dim() == k.dim() == 4 and cos.dim() == 3 and cos.shape == sin.shape
            and q.shape[-1] == k.shape[-1] == cos.shape[-1] and q.shape[-1] % 2 == 0
            and q.shape[2] == k.shape[2] == cos.shape[1] and cos.shape[0] in (1, q.shape[0])
            and q.shape[0] == k.shape[0] and q.stride(-1) == k.stride(-1) == 1
            and cos.stride() == sin.stride() and cos.stride(-1) == 1
            and q.dtype == k.dtype and q.device == cos.device)


def _fused(original: Callable) -> Callable:
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        unsqueeze = kwargs.get("unsqueeze_dim", args[0] if args else 1)
        if (getattr(_inside, "depth", 0) and len(args) + len(kwargs) <= 1 and unsqueeze == 1
                and torch.is_grad_enabled()
                and (q.requires_grad or k.requires_grad) and _standard_call(q, k, cos, sin)):
            return FusedRope.apply(q, k, cos, sin)
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.fused_from = original
    return apply_rotary_pos_emb


def _is_standard(fn: Callable) -> bool:
    """Whether fn(q, k, cos, sin) is the NeoX rotation on a probe input (float64)."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 5, 8, generator=gen, dtype=torch.float64), torch.randn(2, 1, 5, 8, generator=gen,
                                                                                   dtype=torch.float64)
    cos, sin = torch.randn(2, 2, 5, 8, generator=gen, dtype=torch.float64).unbind(0)
    try:
        with torch.no_grad():
            got = fn(q, k, cos, sin)
    except Exception:  # another signature or width (gpt-oss's half-width cos)
        return False
    want = [ops.backend_for("cpu").rope_train(x, cos, sin) for x in (q, k)]  # the oracle
    return (isinstance(got, tuple) and len(got) == 2
            and all(g.shape == w.shape and torch.allclose(g, w, atol=1e-12) for g, w in zip(got, want)))


def _enter(module, args):
    _inside.depth = getattr(_inside, "depth", 0) + 1


def _leave(module, args, output):
    _inside.depth -= 1


def _calls_rope(module: nn.Module) -> bool:
    code = getattr(inspect.unwrap(type(module).forward), "__code__", None)  # under transformers' decorators
    return code is not None and NAME in code.co_names


def install_fused_rope(model: nn.Module) -> int:
    """Fused RoPE for the model's modules whose forward calls its modeling module's
    apply_rotary_pos_emb, where that is the standard rotation: the function patched
    (once per modeling module), the modules hooked (once). Returns how many modules were
    hooked now."""
    count = 0
    for module in model.modules():
        if getattr(module, "_loraplex_fused_rope", False) or not _calls_rope(module):
            continue
        namespace = sys.modules[type(module).__module__]
        fn = getattr(namespace, NAME, None)
        if fn is None or not (hasattr(fn, "fused_from") or _is_standard(fn)):
            continue
        if not hasattr(fn, "fused_from"):
            setattr(namespace, NAME, _fused(fn))
        module.register_forward_pre_hook(_enter)
        module.register_forward_hook(_leave, always_call=True)
        module._loraplex_fused_rope = True
        count += 1
    return count
