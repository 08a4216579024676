"""Fused RMSNorm for LoRA training: one kernel forward, one backward, x saved as it is.

Why: transformers' RMSNorm modules run as ~8 small ops forward (cast to float32, pow,
mean, add, rsqrt, mul, cast, mul) and as many backward, and keep a float32 copy of their
input for backward (bf16 x: 4 bytes an element, twice the input; for every norm of every
layer, q/k norms included). `install_fused_norms` swaps their forward for
`FusedRMSNorm`: one launch forward (ops.rms_norm_train, which also writes each row's
float32 rstd) and one backward (ops.rms_norm_backward, dx only: the base model is frozen),
saving x in its own dtype and rstd [rows] float32, nothing else. Triton on CUDA, plain
torch elsewhere (ops.backend_for).

Which: classes by name (transformers 5's forwards; tests/test_train_norms.py checks each
against its class bit for bit), in three rounding modes, xhat = x.float() * rstd:
  "llama"       LlamaRMSNorm, Qwen2/Qwen3/Qwen3Moe, Mistral, Mixtral, DeepseekV2/V3
                (eps: `variance_epsilon`): weight * xhat.to(x.dtype), rounded first, then
                scaled in the promoted dtype of weight and x;
  "fp32_weight" GptOssRMSNorm (`variance_epsilon`): (weight * xhat).to(x.dtype), scaled
                in float32, then rounded;
  "unit_offset" GemmaRMSNorm, Gemma2RMSNorm, Gemma3RMSNorm (`eps`; weights start at 0):
                (xhat * (1 + weight.float())).type_as(x).
Other classes are left as they are. A module whose weight requires grad is not swapped
(and one unfrozen later runs its class's forward again): the fused backward has no weight
gradient. The forward is set on the instance (a bound method), so the module, its
parameters and the model's state_dict keys are unchanged, and `del module.forward`
restores transformers' own.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from loraplex import ops

# class name -> (rounding mode, eps attribute)
NORM_CLASSES: dict[str, tuple[str, str]] = {
    **{name: ("llama", "variance_epsilon") for name in (
        "LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Qwen3MoeRMSNorm", "MistralRMSNorm", "MixtralRMSNorm",
        "DeepseekV2RMSNorm", "DeepseekV3RMSNorm")},
    "GptOssRMSNorm": ("fp32_weight", "variance_epsilon"),
    **{name: ("unit_offset", "eps") for name in ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm")},
}


class FusedRMSNorm(torch.autograd.Function):
    """y = ops.rms_norm_train(x, weight, eps, mode); dx only (the weight is frozen)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, mode: str) -> torch.Tensor:
        if ctx.needs_input_grad[1]:
            raise ValueError("FusedRMSNorm has no weight gradient: the norm's weight must be frozen")
        y, rstd = ops.rms_norm_train(x, weight, eps, mode)
        ctx.save_for_backward(x, rstd)
        # The frozen parameter, not an activation: held as it is (save_for_backward would
        # hand it to saved-tensor hooks, which may copy it, e.g. offloading ones).
        ctx.weight, ctx.mode = weight, mode
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, rstd = ctx.saved_tensors
        return ops.rms_norm_backward(g, x, rstd, ctx.weight, ctx.mode), None, None, None


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, mode: str) -> torch.Tensor:
    """The norm, through FusedRMSNorm where a gradient will flow to x."""
    if torch.is_grad_enabled() and x.requires_grad:
        return FusedRMSNorm.apply(x, weight, eps, mode)
    return ops.rms_norm_train(x, weight, eps, mode)[0]


def _fused_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The instance forward that install_fused_norms sets (bound to the module)."""
    if self.weight.requires_grad:  # unfrozen since: the fused backward would drop its gradient
        return type(self).forward(self, hidden_states)
    mode, eps_attr = NORM_CLASSES[type(self).__name__]
    return fused_rms_norm(hidden_states, self.weight, getattr(self, eps_attr), mode)


def is_fused(module: nn.Module) -> bool:
    forward = vars(module).get("forward")
    return isinstance(forward, types.MethodType) and forward.__func__ is _fused_forward


def install_fused_norms(model: nn.Module) -> int:
    """Swap the forward of every RMSNorm of a class in NORM_CLASSES whose weight is frozen
    for the fused one; returns how many were swapped (modules already fused not counted)."""
    count = 0
    for module in model.modules():
        if type(module).__name__ not in NORM_CLASSES or is_fused(module):
            continue
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.requires_grad:
            continue
        module.forward = types.MethodType(_fused_forward, module)
        count += 1
    return count
