"""LoRA injected into a transformers model for training (loraplex's own, not PEFT's).

- `LoRALinear` wraps an nn.Linear: `base(x) + s (x A^T) B^T`, A [r, in] kaiming-uniform
  as PEFT initialises it, B [out, r] zeros, so training starts at the base model.
- `LoRAExperts` wraps a transformers experts module (3D `gate_up_proj` / `down_proj`,
  [E, out, in], or [E, in, out] when `is_transposed` as gpt-oss stores them, gate/up
  interleaved there): per expert A [E, r, in], B [E, out, r] on both projections, run as
  grouped GEMMs over expert-sorted pairs (train/moe.py, train/expert_gemm.py). Out rows of gate_up keep the
  checkpoint's order (gpt-oss: interleaved), as PEFT's target_parameters layout does.
The LoRA factors stay float32 (the optimizer's master copy) and are cast to the
activations' dtype in the forward; every base parameter is frozen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from loraplex.train.expert_gemm import FoldedStack
from loraplex.train.moe import CombineByToken, ExpertProjection, GatedDown, SortedPairs, sort_pairs
from loraplex.train.quantized import FrozenWeight, QuantizedLinear

LINEAR_TYPES = (nn.Linear, QuantizedLinear)  # a quantized base's projections (train/quantized.py)

# Attention projections by name: the usual four, and DeepSeek's latent attention (q_proj or
# q_a_proj / q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj).
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                     "kv_b_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
LINEAR_TARGETS = ATTENTION_TARGETS + MLP_TARGETS
EXPERT_PARAMS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class LoRASpec:
    rank: int
    alpha: float
    targets: tuple[str, ...]  # module names, plus "experts" for MoE experts
    use_rslora: bool = False

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def _init_a(a: torch.Tensor) -> None:
    # PEFT: kaiming_uniform_(a=sqrt(5)) on each [r * E, in] lora_A, i.e. bound 1/sqrt(in).
    nn.init.kaiming_uniform_(a.view(-1, a.shape[-1]), a=math.sqrt(5))


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear | QuantizedLinear, spec: LoRASpec):
        super().__init__()
        self.base_layer, self.scale = base, spec.scale
        dev = base.weight.device
        self.lora_A = nn.Parameter(torch.empty(spec.rank, base.in_features, device=dev))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, spec.rank, device=dev))
        _init_a(self.lora_A.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)
        y = self.base_layer(x)
        xa = nn.functional.linear(x, a)
        # The expand accumulates into the base output in its GEMM (addmm's beta = 1):
        # no separate scale and add passes over [tokens, out], forward or backward.
        out = torch.addmm(y.reshape(-1, y.shape[-1]), xa.reshape(-1, xa.shape[-1]), b.t(), alpha=self.scale)
        return out.view(y.shape)


def is_experts(module: nn.Module) -> bool:
    return all(isinstance(getattr(module, p, None), nn.Parameter | FrozenWeight)
               and len(getattr(module, p).shape) == 3 for p in EXPERT_PARAMS)


def _is_silu_gate(experts: nn.Module) -> bool:
    """transformers' default gate (gate, up = chunk(2); act(gate) * up) with SiLU: Qwen3-MoE,
    Mixtral. Those run activation, down projection and sum as one GatedDown node; any other
    gate runs as transformers does."""
    gate = getattr(type(experts), "_apply_gate", None)
    act = getattr(experts, "act_fn", None)
    return (getattr(gate, "__name__", "") == "_default_apply_gate"
            and (isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"))


class LoRAExperts(nn.Module):
    """Drop-in for an experts module: forward(hidden [T, H], top_k_index, top_k_weights).

    SwiGLU experts (Qwen3-MoE, Mixtral) stored [E, out, in] in a plain tensor, at a rank
    that keeps rows 16-byte aligned (a multiple of 8), are folded (train/expert_gemm.py,
    FoldedStack; `fold=False` keeps them apart): the base parameter becomes a view of the
    folded stack, same shape and values."""

    def __init__(self, base: nn.Module, spec: LoRASpec | None, backend: str = "loop", fold: bool = True):
        super().__init__()
        self.base_layer, self.backend = base, backend
        self.scale = spec.scale if spec is not None else 0.0  # None: the base alone (quantized experts)
        self.transposed = bool(getattr(base, "is_transposed", False))
        self.num_experts = base.gate_up_proj.shape[0]
        self.silu_gate = _is_silu_gate(base)
        for p in EXPERT_PARAMS if spec is not None else ():
            e, in_f, out_f = self.in_out(p)
            dev = getattr(base, p).device
            a = nn.Parameter(torch.empty(e, spec.rank, in_f, device=dev))
            _init_a(a.data)
            setattr(self, f"{p}_A", a)
            setattr(self, f"{p}_B", nn.Parameter(torch.zeros(e, out_f, spec.rank, device=dev)))
        # Folded stacks are buffers (not saved: the state_dict keeps the base's keys), so
        # that .to() moves them.
        self.fold_rank = 0
        plain = self.silu_gate and not self.transposed and all(
            type(getattr(base, p)) is nn.Parameter and not getattr(base, p).is_meta
            and getattr(base, f"{p}_bias", None) is None for p in EXPERT_PARAMS)
        if fold and plain and spec is not None and spec.rank % 8 == 0:
            self.fold_rank = spec.rank
            for p in EXPERT_PARAMS:
                stack = FoldedStack.around(getattr(base, p).data, spec.rank)
                self.register_buffer(f"{p}_folded", stack.ext, persistent=False)
                setattr(base, p, nn.Parameter(stack.view(), requires_grad=False))

    def in_out(self, param: str) -> tuple[int, int, int]:
        e, d1, d2 = getattr(self.base_layer, param).shape
        return (e, d1, d2) if self.transposed else (e, d2, d1)

    def _factors(self, param: str):
        """The base weight [E, in, out] (a quantized one: StackSlices that make it) and the
        LoRA factors A [E, in, r], B [E, r, out] (float32 parameters, as views) of one
        projection."""
        if self.fold_rank:
            w = FoldedStack(getattr(self, f"{param}_folded"), self.fold_rank)
        else:
            w = getattr(self.base_layer, param)
            if isinstance(w, FrozenWeight):  # canonical [E, out, in] -> [E, in, out]
                w = w.experts(transpose=True)
            elif not self.transposed:
                w = w.transpose(1, 2)
        if not hasattr(self, f"{param}_A"):
            return w, None, None
        return w, getattr(self, f"{param}_A").transpose(1, 2), getattr(self, f"{param}_B").transpose(1, 2)

    def _project(self, x, param: str, pairs: SortedPairs, gather: bool = False) -> torch.Tensor:
        y = ExpertProjection.apply(x, *self._factors(param), self.scale, pairs.groups, self.backend,
                                   pairs if gather else None)
        bias = getattr(self.base_layer, f"{param}_bias", None)
        return y if bias is None else y + bias[pairs.experts]

    def forward(self, hidden_states, top_k_index, top_k_weights):
        pairs = sort_pairs(top_k_index, self.num_experts)
        # gate/up gathers the routed rows itself (sorted by expert) and keeps only the input
        gate_up = self._project(hidden_states, "gate_up_proj", pairs, gather=True)
        if self.silu_gate and getattr(self.base_layer, "down_proj_bias", None) is None:
            return GatedDown.apply(gate_up, top_k_weights, *self._factors("down_proj"), self.scale, pairs,
                                   self.backend, self.fold_rank)  # room for gate/up's s g B
        # gpt-oss (clamped gate, biases; the bias is weighted too, as transformers does)
        weights = top_k_weights.reshape(-1)[pairs.order].to(gate_up.dtype)
        y = self._project(self.base_layer._apply_gate(gate_up), "down_proj", pairs) * weights[:, None]
        return CombineByToken.apply(y, pairs)


def default_targets(model: nn.Module) -> tuple[str, ...]:
    """Every linear projection of attention and MLP the model has; on an MoE model
    attention + experts."""
    present = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, LINEAR_TYPES)}
    attention = tuple(t for t in ATTENTION_TARGETS if t in present)
    if any(is_experts(m) for m in model.modules()):
        return (*attention, "experts")
    return (*attention, *MLP_TARGETS)


def inject_lora(model: nn.Module, spec: LoRASpec, moe_backend: str = "loop",
                fold_experts: bool = True) -> dict[str, nn.Module]:
    """Freeze the model and wrap every targeted module in place; module path -> wrapper.
    fold_experts=False keeps expert stacks and their LoRA factors apart (LoRAExperts)."""
    model.requires_grad_(False)
    linear = set(spec.targets) - {"experts"}
    unknown = linear - set(LINEAR_TARGETS)
    if unknown:
        raise ValueError(f"unknown LoRA targets {sorted(unknown)}: use {LINEAR_TARGETS} or 'experts'")
    moe = any(is_experts(m) for m in model.modules())
    if moe and linear & set(MLP_TARGETS):
        # PEFT (with transformers 5) reads these names on an MoE model as the experts of
        # transformers 4 and converts them to target_parameters: the adapter would not load.
        raise ValueError(f"{sorted(linear & set(MLP_TARGETS))} on an MoE model: PEFT reads them as its "
                         "experts; target 'experts' (attention and experts train, dense MLPs stay frozen)")
    wrapped: dict[str, nn.Module] = {}
    for name, module in list(model.named_modules()):
        if name.rsplit(".", 1)[-1] in linear and isinstance(module, LINEAR_TYPES):
            wrapped[name] = LoRALinear(module, spec)
        elif "experts" in spec.targets and is_experts(module):
            wrapped[name] = LoRAExperts(module, spec, moe_backend, fold_experts)
    hit = {n.rsplit(".", 1)[-1] for n, m in wrapped.items() if isinstance(m, LoRALinear)}
    if any(isinstance(m, LoRAExperts) for m in wrapped.values()):
        hit.add("experts")
    if set(spec.targets) - hit:
        raise ValueError(f"LoRA targets {sorted(set(spec.targets) - hit)} match nothing in this model")
    # A quantized base's experts not trained still run through LoRAExperts (transformers'
    # experts cannot read a FrozenWeight): the base alone, not among the wrapped.
    frozen = {name: LoRAExperts(m, None, moe_backend) for name, m in model.named_modules()
              if name not in wrapped and is_experts(m) and isinstance(m.gate_up_proj, FrozenWeight)}
    for name, wrapper in {**wrapped, **frozen}.items():
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, wrapper)
    return wrapped


def lora_parameters(wrapped: dict[str, nn.Module]) -> list[nn.Parameter]:
    """The trainable tensors, in a fixed order (the optimizer state's order)."""
    return [p for _, m in sorted(wrapped.items()) for n, p in m.named_parameters() if "base_layer" not in n]
