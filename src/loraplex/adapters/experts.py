"""Adapters on MoE experts -> one canonical layout per experts module.

Two on-disk layouts:
- PEFT `target_parameters` (the experts' 3D parameters wrapped directly): per experts
  module `lora_A` [E*r, in] with the expert index slowest and `lora_B` [out, E*r] with it
  fastest. Wrapping both gate_up_proj and down_proj nests the wrappers in parameter
  order: `experts.base_layer.lora_A/B` is gate_up_proj, `experts.lora_A/B` down_proj
  (a single targeted parameter is `experts.lora_A/B`).
- per-expert modules: `experts.E.gate_proj/up_proj/down_proj.lora_A/B` (Mixtral's
  w1/w3/w2), each a plain [r, in] / [out, r] pair.

Canonical (ExpertLoRA): A [E, r, in], B [E, out, r] per path, scaling folded into B. The
gate_up path is one matrix: gate_proj/up_proj pairs stack as A = [A_gate; A_up],
B = [[B_gate, 0], [0, B_up]] (rank r_gate + r_up); PEFT's fused layout has one A.
Experts an adapter leaves out of a per-expert layout get zeros.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from loraplex.errors import AdapterInvalid, AdapterTooLarge


@dataclass(frozen=True)
class ExpertShape:
    """What an adapter may put on one experts module."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    # gpt-oss: checkpoint gate_up columns interleave gate and up (g0, u0, g1, u1, ...);
    # loraplex stores gate rows then up rows, so adapter B rows are reordered the same way.
    interleaved: bool = False


@dataclass
class ExpertLoRA:
    a_gate_up: torch.Tensor | None  # [E, r_gu, H]
    b_gate_up: torch.Tensor | None  # [E, 2I, r_gu]
    a_down: torch.Tensor | None  # [E, r_d, I]
    b_down: torch.Tensor | None  # [E, H, r_d]

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.a_gate_up, self.b_gate_up, self.a_down, self.b_down) if t is not None]


_PER_EXPERT = re.compile(r"^(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)$")
_MIXTRAL = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def owner(module: str, experts: Mapping[str, ExpertShape]) -> tuple[str, str] | None:
    """(experts path, the rest of the module path) if `module` lies in an experts module."""
    for path in experts:
        if module == path:
            return path, ""
        if module.startswith(path + "."):
            return path, module[len(path) + 1 :]
    return None


def canonical_experts(
    name: str,
    config: dict,
    found: Mapping[str, Mapping[str, Mapping[str, torch.Tensor]]],
    experts: Mapping[str, ExpertShape],
    scaling_of: Callable[[str, int], float],
    max_rank: int,
) -> dict[str, ExpertLoRA]:
    """found: experts path -> rest of module path -> {"A", "B"} tensors (float32 out).
    scaling_of(module path, rank) -> that module's LoRA scaling."""
    out = {}
    for path, parts in found.items():
        shape = experts[path]
        if any(_PER_EXPERT.match(rest) for rest in parts):
            out[path] = _per_expert(name, path, parts, shape, scaling_of, max_rank)
        else:
            out[path] = _fused(name, config, path, parts, shape, scaling_of, max_rank)
    return out


def _pair(name: str, module: str, ab: Mapping[str, torch.Tensor], in_f: int, out_f: int,
          max_rank: int, per: int = 1) -> tuple[torch.Tensor, torch.Tensor, int]:
    if set(ab) != {"A", "B"}:
        raise AdapterInvalid(name, f"{module} has lora_{''.join(sorted(ab))} but not both A and B")
    a, b = ab["A"], ab["B"]
    r = a.shape[0] // per if a.dim() == 2 else -1
    if a.dim() != 2 or b.dim() != 2 or a.shape != (r * per, in_f) or b.shape != (out_f, r * per) or r < 1:
        raise AdapterInvalid(name, f"{module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit "
                             f"{per} expert(s) of {in_f} -> {out_f}")
    if r > max_rank:
        raise AdapterTooLarge(name, f"rank {r} of {module} exceeds max_lora_rank={max_rank}")
    return a, b, r


def _fused(name, config, path, parts, shape: ExpertShape, scaling_of, max_rank) -> ExpertLoRA:
    targeted = [p for p in ("gate_up_proj", "down_proj")
                if any(str(t).endswith(p) for t in config.get("target_parameters") or ())]
    # Nested wrappers, innermost first: parameter order gate_up_proj, down_proj.
    keys = {"": targeted[-1]} if len(targeted) == 1 else {"base_layer": "gate_up_proj", "": "down_proj"}
    unknown = set(parts) - set(keys) if targeted else set(parts)
    if unknown:
        raise AdapterInvalid(name, f"targets {path}.{sorted(unknown)[0] or 'lora_A'} (target_parameters "
                             f"{config.get('target_parameters')}), which this model cannot adapt")
    e, h, i = shape.num_experts, shape.hidden_size, shape.intermediate_size
    res = ExpertLoRA(None, None, None, None)
    for rest, param in keys.items():
        if rest not in parts:
            continue
        in_f, out_f = (h, 2 * i) if param == "gate_up_proj" else (i, h)
        module = f"{path}.{param}"
        a, b, r = _pair(name, module, parts[rest], in_f, out_f, max_rank, per=e)
        a = a.float().reshape(e, r, in_f)
        b = b.float().reshape(out_f, r, e).permute(2, 0, 1) * scaling_of(module, r)
        if param == "gate_up_proj":
            res.a_gate_up, res.b_gate_up = a.contiguous(), _deinterleave(b, shape).contiguous()
        else:
            res.a_down, res.b_down = a.contiguous(), b.contiguous()
    return res


def _per_expert(name, path, parts, shape: ExpertShape, scaling_of, max_rank) -> ExpertLoRA:
    e_n, h, i = shape.num_experts, shape.hidden_size, shape.intermediate_size
    by_proj: dict[str, dict[int, tuple]] = {}
    for rest, ab in parts.items():
        m = _PER_EXPERT.match(rest)
        if m is None or int(m["e"]) >= e_n:
            raise AdapterInvalid(name, f"targets {path}.{rest}, which this model cannot adapt")
        proj = _MIXTRAL.get(m["proj"], m["proj"])
        in_f, out_f = (i, h) if proj == "down_proj" else (h, i)
        module = f"{path}.{rest}"
        a, b, r = _pair(name, module, ab, in_f, out_f, max_rank)
        by_proj.setdefault(proj, {})[int(m["e"])] = (a.float(), b.float() * scaling_of(module, r))
    rank = {p: max(a.shape[0] for a, _ in ex.values()) for p, ex in by_proj.items()}
    res = ExpertLoRA(None, None, None, None)
    rg, ru = rank.get("gate_proj", 0), rank.get("up_proj", 0)
    if rg + ru:
        res.a_gate_up = torch.zeros(e_n, rg + ru, h)
        res.b_gate_up = torch.zeros(e_n, 2 * i, rg + ru)
        for proj, rows, cols in (("gate_proj", slice(0, i), 0), ("up_proj", slice(i, 2 * i), rg)):
            for e, (a, b) in by_proj.get(proj, {}).items():
                r = a.shape[0]
                res.a_gate_up[e, cols : cols + r] = a
                res.b_gate_up[e, rows, cols : cols + r] = b
    if "down_proj" in by_proj:
        r_down = rank["down_proj"]
        res.a_down, res.b_down = torch.zeros(e_n, r_down, i), torch.zeros(e_n, h, r_down)
        for e, (a, b) in by_proj["down_proj"].items():
            res.a_down[e, : a.shape[0]], res.b_down[e, :, : a.shape[0]] = a, b
    return res


def _deinterleave(b: torch.Tensor, shape: ExpertShape) -> torch.Tensor:
    # b [E, 2I, r] in checkpoint column order -> gate rows, then up rows.
    return torch.cat([b[:, 0::2], b[:, 1::2]], dim=1) if shape.interleaved else b


def lora_scaling(config: dict, alpha: float, r: int) -> float:
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
