"""Weights in and out of a model: Hugging Face safetensors, and random dummy weights.

Checkpoint names are Hugging Face's. Projections fused in loraplex (q/k/v into qkv_proj,
gate/up into gate_up_proj) are found through `projection_index`, which maps each
original projection's module path to its fused layer and output slice; the same index
tells the adapter loader where each PEFT module's delta goes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from loraplex.adapters.experts import ExpertShape
from loraplex.adapters.peft import AdapterTargets
from loraplex.config import QuantConfig
from loraplex.errors import ModelLoadError
from loraplex.layers.linear import LoRALinear
from loraplex.layers.moe import Experts
from loraplex.layers.parallel import Shard
from loraplex.ops.formats import QuantizedWeight
from loraplex.ops.formats.checkpoint import (
    dequantized_weight,
    ingest,
    init_quantized,
    safetensors_files,
    stored_quantized,
)

# Checkpoint tensors that carry no weights (recomputed buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# One expert's projection in a per-expert MoE checkpoint -> the fused 3D parameter.
_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)"
                     r"\.(?P<kind>weight|weight_scale_inv|weight_scale|qweight|qzeros|scales|g_idx)$")
_MIXTRAL_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


@dataclass(frozen=True)
class Projection:
    """Where an original projection (e.g. model.layers.3.self_attn.k_proj) lives."""

    layer_path: str  # the fused LoRALinear, e.g. model.layers.3.self_attn.qkv_proj
    layer: LoRALinear
    slice: int  # output slice inside the fused layer

    @property
    def in_features(self) -> int:
        """The full projection's (the whole model's, under tensor parallelism)."""
        tp = self.layer.tp
        return self.layer.in_features if tp is None else tp.full_in

    @property
    def out_features(self) -> int:
        tp = self.layer.tp
        return self.layer.output_sizes[self.slice] if tp is None else tp.full_sizes[self.slice]


def projection_index(model: nn.Module) -> dict[str, Projection]:
    index = {}
    for path, module in model.named_modules():
        if isinstance(module, LoRALinear):
            parent = path.rpartition(".")[0]
            for i, name in enumerate(module.slice_names):
                index[f"{parent}.{name}" if parent else name] = Projection(path, module, i)
    return index


def expert_modules(model: nn.Module) -> dict[str, Experts]:
    """Path -> experts module (fused 3D expert weights)."""
    return {path: m for path, m in model.named_modules() if isinstance(m, Experts)}


def adapted_modules(model: nn.Module, target_modules: tuple[str, ...] | None = None
                    ) -> tuple[dict[str, Projection], dict[str, Experts]]:
    """The projections and experts modules that get adapter slots: every one, or those
    whose name (a path's last part: q_proj, gate, `experts`) is in target_modules. A
    name that matches nothing in the model fails, as a typo would."""
    projections, experts = projection_index(model), expert_modules(model)
    if target_modules is None:
        return projections, experts
    names = {k.rpartition(".")[2] for k in projections} | {k.rpartition(".")[2] for k in experts}
    unknown = [m for m in target_modules if m not in names]
    if unknown:
        raise ValueError(f"lora_target_modules {', '.join(unknown)}: this model has no such module "
                         f"(it has {', '.join(sorted(names))})")
    keep = set(target_modules)
    return ({k: p for k, p in projections.items() if k.rpartition(".")[2] in keep},
            {k: x for k, x in experts.items() if k.rpartition(".")[2] in keep})


def adapter_targets(model: nn.Module, target_modules: tuple[str, ...] | None = None) -> AdapterTargets:
    """Everything of `model` an adapter may target, as the adapter loader checks it: the
    model's projections and experts (their sizes bound a file's), of which the engine
    adapts those in target_modules (None: all; the names as `adapted_modules` checked them)."""
    interleaved = getattr(model, "checkpoint_gate_up_interleaved", False)
    projections, experts = projection_index(model), expert_modules(model)
    return AdapterTargets(
        projections={k: (p.in_features, p.out_features) for k, p in projections.items()},
        experts={path: ExpertShape(m.num_experts, m.hidden_size, _full_intermediate(m), interleaved)
                 for path, m in experts.items()},
        renames=dict(getattr(model, "checkpoint_renames", {})),
        dora=not any(isinstance(m, LoRALinear) and m.tp is not None for m in model.modules()),
        only=target_modules,
    )


def _full_intermediate(experts: Experts) -> int:
    return experts.intermediate_size if experts.tp is None else experts.tp.full_intermediate


def load_safetensors(model: nn.Module, model_dir: str | Path, tied_embeddings: bool,
                     quant: QuantConfig | None = None, shards: dict[str, Shard] | None = None) -> None:
    """Copy every checkpoint tensor into `model`; fail on missing or unexpected names.
    shards: a tensor-parallel rank's part of each split parameter (models/tensor_parallel.py);
    projections and experts take theirs from their layers' `tp`.

    A model class may declare `checkpoint_renames` (old -> new name substrings), a
    `checkpoint_transform(name, tensor) -> tensor` (after renames) for tensors stored in
    another layout than its own, and `checkpoint_skips(name) -> bool` for tensors it
    leaves out. Layers holding quantized weights (models/quant.py) take
    the checkpoint's quantized tensors through quant.ingest."""
    index = projection_index(model)
    params = dict(model.named_parameters())
    quantized = _quantized_weights(model)
    expected = set()  # projections' weights by their checkpoint module (q_proj, not qkv_proj)
    for module_path, p in index.items():
        w = p.layer.weight
        kinds = ["weight"] if isinstance(w, nn.Parameter) else [b for b, _ in w.named_buffers(recurse=False)]
        expected |= {f"{module_path}.{k}" for k in kinds}
        if p.layer.bias is not None:
            expected.add(f"{module_path}.bias")
    fused = {f"{p.layer_path}.{n}" for p in index.values() for n in ("weight", "bias")}
    expected |= {n for n in params if n not in fused}
    expected |= {f"{path}.{b}" for path, w in quantized.items() if not path.endswith(".weight")
                 for b, _ in w.named_buffers(recurse=False)}
    loaded: set[str] = set()
    expert_parts: dict[str, set] = {}  # fused expert weight (or buffer) -> (expert, part) loaded
    kept_parts: dict[str, dict] = {}  # a kept projection's quantized tensors until all have come

    files = safetensors_files(model_dir)
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    names = [(h, n) for h in handles for n in h.keys()]
    renames = getattr(model, "checkpoint_renames", {})
    transform = getattr(model, "checkpoint_transform", None)
    skips = getattr(model, "checkpoint_skips", None)  # name -> True for tensors serving leaves out
    for handle, ckpt_name in tqdm(names, desc="Loading weights", unit="tensor", leave=False):
        name = ckpt_name
        for old, new in renames.items():
            name = name.replace(old, new)
        module_path, _, kind = name.rpartition(".")
        if name.endswith(_IGNORED_SUFFIXES) or (tied_embeddings and name == "lm_head.weight") or (
                skips is not None and skips(name)):
            continue
        tensor = handle.get_tensor(ckpt_name)
        if transform is not None:
            tensor = transform(name, tensor)
        kept = module_path in index and isinstance(index[module_path].layer.weight, nn.Parameter)
        if kept and quant is not None and stored_quantized(quant, kind, tensor):
            # a projection the model keeps in its dtype, stored quantized: dequantized whole
            parts = kept_parts.setdefault(module_path, {})
            parts[kind] = tensor
            tensor = dequantized_weight(quant, parts, module_path)
            if tensor is None:
                continue
            del kept_parts[module_path]
            kind, name = "weight", f"{module_path}.weight"
        expert = _EXPERT.match(name)
        if expert is not None and f"{expert['experts']}.gate_up_proj" in quantized:
            key, w, rows = _expert_rows(model, quantized, expert)
            for done in ingest(w, quant, expert["kind"], tensor, (int(expert["e"]), rows), name):
                expert_parts.setdefault(f"{key}.{done}", set()).add((expert["e"], expert["proj"]))
            continue
        if expert is not None and f"{expert['experts']}.gate_up_proj" in params:
            fused_name, dest = _expert_slice(params, expert)
            tensor = _expert_part(model, expert, tensor)
            expert_parts.setdefault(fused_name, set()).add((expert["e"], expert["proj"]))
            key = None  # complete once every expert's part has come
        elif module_path in index and kind != "bias" and not isinstance(index[module_path].layer.weight,
                                                                         nn.Parameter):
            proj = index[module_path]
            done = ingest(proj.layer.weight, quant, kind, tensor, (proj.layer.slice_rows(proj.slice),), name)
            loaded |= {f"{module_path}.{d}" for d in done}
            continue
        elif module_path in index:
            proj = index[module_path]
            if getattr(proj.layer, kind, None) is None:  # (a router's score bias is one of its own)
                takes = "a weight and a bias" if proj.layer.bias is not None else "a weight, no bias"
                hint = (" (quantized tensors need the config's quantization_config)"
                        if quant is None and kind != "bias" else "")
                raise ModelLoadError(f"unexpected tensor {name!r} in {model_dir}: {module_path} takes "
                                     f"{takes}{hint}")
            dest = getattr(proj.layer, kind)[proj.layer.slice_rows(proj.slice)]
            if proj.layer.tp is not None:
                tp = proj.layer.tp
                tensor = (tp.weight if kind == "weight" else tp.bias)(proj.slice).take(tensor)
            key = name
        elif name in quantized and quant.online:  # a whole bf16 expert stack, quantized as it loads
            for e in range(tensor.shape[0]):  # an expert at a time (the quantizer's temporaries)
                done = ingest(quantized[name], quant, "weight", tensor[e], (e,), name)
            loaded |= {f"{name}.{d}" for d in done}
            continue
        elif name not in params and (stem := _fused_quantized(name, quantized)) is not None:  # *_blocks
            done = ingest(quantized[stem], quant, kind, tensor, (), name)
            loaded |= {f"{stem}.{d}" for d in done}
            continue
        elif name in params:
            dest, key = params[name].data, name
            if shards and name in shards:
                tensor = shards[name].take(tensor)
        else:
            raise ModelLoadError(f"unexpected tensor {name!r} in {model_dir}")
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ModelLoadError(
                f"{name}: checkpoint shape {tuple(tensor.shape)}, model expects {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
        if key is not None:
            loaded.add(key)
    for key, parts in expert_parts.items():
        experts = key.rpartition(".gate_up_proj")[0] or key.rpartition(".down_proj")[0]
        num_experts = model.get_submodule(experts).num_experts
        if len(parts) == num_experts * (2 if ".gate_up_proj" in key else 1):
            loaded.add(key)
    if kept_parts:
        path, parts = next(iter(kept_parts.items()))
        raise ModelLoadError(f"{path}: stored quantized, but the checkpoint has only its {sorted(parts)}")
    missing = sorted(expected - loaded)
    if missing:
        raise ModelLoadError(f"{model_dir} lacks {len(missing)} weights, e.g. {missing[:3]}")


def _quantized_weights(model: nn.Module) -> dict[str, QuantizedWeight]:
    """Experts' quantized weights by parameter path (`...experts.gate_up_proj`)."""
    return {f"{path}.{name}": getattr(m, name) for path, m in model.named_modules() if isinstance(m, Experts)
            for name in ("gate_up_proj", "down_proj") if isinstance(getattr(m, name), QuantizedWeight)}


def _fused_quantized(name: str, quantized: dict[str, QuantizedWeight]) -> str | None:
    """The fused expert weight a whole-stack tensor (`...experts.gate_up_proj_blocks`) is
    part of, or None."""
    return next((stem for stem in quantized if name.startswith(stem + "_")), None)


def _expert_rows(model: nn.Module, quantized: dict, m: re.Match) -> tuple[str, QuantizedWeight, slice]:
    """Where one expert's checkpoint module goes in a quantized fused expert weight."""
    proj = _MIXTRAL_PARTS.get(m["proj"], m["proj"])
    key = f"{m['experts']}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
    w = quantized[key]
    if proj == "down_proj":
        return key, w, slice(None)
    inter = w.shape[-2] // 2
    return key, w, slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)


def _expert_part(model: nn.Module, m: re.Match, tensor: torch.Tensor) -> torch.Tensor:
    """A per-expert checkpoint matrix, cut to a tensor-parallel rank's rows (gate, up)
    or columns (down)."""
    tp = model.get_submodule(m["experts"]).tp
    if tp is None:
        return tensor
    down = _MIXTRAL_PARTS.get(m["proj"], m["proj"]) == "down_proj"
    return tp.down(1).take(tensor) if down else tensor[tp.lo:tp.hi]


def _expert_slice(params: dict, m: re.Match) -> tuple[str, torch.Tensor]:
    """Where one expert's gate/up/down matrix goes in the fused [E, 2I, H] / [E, H, I]."""
    e, proj = int(m["e"]), _MIXTRAL_PARTS.get(m["proj"], m["proj"])
    if proj == "down_proj":
        key = f"{m['experts']}.down_proj"
        return key, params[key].data[e]
    key = f"{m['experts']}.gate_up_proj"
    inter = params[key].shape[1] // 2
    rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
    return key, params[key].data[e, rows]


def init_dummy(model: nn.Module, std: float, seed: int, shards: dict[str, Shard] | None = None) -> None:
    """Random weights at trained scale: matrices N(0, std), norms 1 (Gemma's (1 + w)
    norms 0), biases and attention sinks 0. A tensor-parallel rank draws each split
    matrix whole and keeps its part (`shards`): every rank, and an unsplit model, then
    hold the same weights."""
    zero = {id(m.weight) for m in model.modules() if getattr(m, "unit_offset", False)}
    gen = None
    for name, p in model.named_parameters():
        if gen is None:
            gen = torch.Generator(device=p.device).manual_seed(seed)
        if p.dim() >= 2 and shards and name in shards:
            shard = shards[name]
            full = torch.empty(shard.full_shape(p.shape), dtype=p.dtype, device=p.device)
            p.data.copy_(shard.take(full.normal_(0.0, std, generator=gen)))
        elif p.dim() >= 2:
            p.data.normal_(0.0, std, generator=gen)
        elif name.endswith(("bias", "sinks")) or id(p) in zero:
            p.data.zero_()
        else:
            p.data.fill_(1.0)
    for w in model.modules():  # quantized: N(0, std) in their format
        if isinstance(w, QuantizedWeight):
            init_quantized(w, std, gen)


def checkpoint_tensor_names(model: nn.Module, model_dir: str | Path) -> set[str]:
    """The checkpoint's tensor names as the model calls them (its checkpoint_renames)."""
    renames = getattr(model, "checkpoint_renames", {})
    names = set()
    for f in safetensors_files(model_dir):
        with safe_open(str(f), framework="pt", device="cpu") as h:
            for name in h.keys():
                for old, new in renames.items():
                    name = name.replace(old, new)
                names.add(name)
    return names
