"""Trained LoRA <-> a PEFT adapter directory (adapter_config.json + adapter_model.safetensors).

Keys are PEFT's: `base_model.model.<module>.lora_A.weight` / `lora_B.weight`. Experts
use PEFT's `target_parameters` layout: per experts module A [E*r, in] with the expert
index slowest and B [out, E*r] with it fastest; both gate_up_proj and down_proj wrapped
nest PEFT's wrappers in parameter order, so `<experts>.base_layer.lora_*` is gate_up_proj
and `<experts>.lora_*` is down_proj. transformers + PEFT and loraplex both read it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from loraplex.train.lora import EXPERT_PARAMS, LoRAExperts, LoRALinear, LoRASpec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def _expert_keys(path: str) -> dict[str, str]:
    return {"gate_up_proj": f"{path}.base_layer", "down_proj": path}


def peft_tensors(wrapped: dict[str, nn.Module], grads: bool = False) -> dict[str, torch.Tensor]:
    """PEFT key -> tensor (the LoRA weights, or their gradients with grads=True)."""

    def get(p: nn.Parameter) -> torch.Tensor:
        t = p.grad if grads else p.data
        return torch.zeros_like(p.data) if t is None else t.detach()

    out = {}
    for path, m in sorted(wrapped.items()):
        if isinstance(m, LoRALinear):
            out[f"base_model.model.{path}.lora_A.weight"] = get(m.lora_A)
            out[f"base_model.model.{path}.lora_B.weight"] = get(m.lora_B)
        elif isinstance(m, LoRAExperts):
            for param, key in _expert_keys(path).items():
                a, b = get(getattr(m, f"{param}_A")), get(getattr(m, f"{param}_B"))
                e, out_f, r = b.shape
                out[f"base_model.model.{key}.lora_A.weight"] = a.reshape(e * r, -1)
                out[f"base_model.model.{key}.lora_B.weight"] = b.permute(1, 2, 0).reshape(out_f, r * e)
    return {k: v.float().contiguous().cpu() for k, v in out.items()}


@torch.no_grad()
def load_peft_tensors(wrapped: dict[str, nn.Module], tensors: dict[str, torch.Tensor]) -> None:
    """Inverse of `peft_tensors`: copy an adapter's weights into the wrappers."""
    used = set()

    def take(key: str) -> torch.Tensor:
        used.add(key)
        return tensors[key]

    for path, m in wrapped.items():
        if isinstance(m, LoRALinear):
            m.lora_A.copy_(take(f"base_model.model.{path}.lora_A.weight"))
            m.lora_B.copy_(take(f"base_model.model.{path}.lora_B.weight"))
        elif isinstance(m, LoRAExperts):
            for param, key in _expert_keys(path).items():
                a, b = getattr(m, f"{param}_A"), getattr(m, f"{param}_B")
                e, out_f, r = b.shape
                a.copy_(take(f"base_model.model.{key}.lora_A.weight").reshape(a.shape))
                b.copy_(take(f"base_model.model.{key}.lora_B.weight").reshape(out_f, r, e).permute(2, 0, 1))
    if set(tensors) - used:
        raise ValueError(f"adapter tensors this model has no LoRA for: {sorted(set(tensors) - used)[:3]}")


def adapter_config(wrapped: dict[str, nn.Module], spec: LoRASpec, base_model: str) -> dict:
    linear = sorted({p.rsplit(".", 1)[-1] for p, m in wrapped.items() if isinstance(m, LoRALinear)})
    # PEFT matches target_parameters as suffixes of parameter names: "mlp.experts.down_proj".
    owners = sorted({".".join(p.split(".")[-2:]) for p, m in wrapped.items() if isinstance(m, LoRAExperts)})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": spec.rank, "lora_alpha": spec.alpha, "use_rslora": spec.use_rslora,
        "target_modules": linear, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "init_lora_weights": True, "inference_mode": True,
    }
    if owners:
        config["target_parameters"] = [f"{o}.{p}" for o in owners for p in EXPERT_PARAMS]
    return config


def save_adapter(out_dir: str | Path, wrapped: dict[str, nn.Module], spec: LoRASpec, base_model: str) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(peft_tensors(wrapped), str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    config = adapter_config(wrapped, spec, base_model)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out


def load_adapter_weights(adapter_dir: str | Path, wrapped: dict[str, nn.Module]) -> None:
    load_peft_tensors(wrapped, load_file(str(Path(adapter_dir) / WEIGHTS_FILE)))
