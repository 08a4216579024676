"""PEFT LoRA adapters (adapter_config.json + adapter_model.safetensors) -> LoRAAdapter.

Everything an adapter directory can get wrong is checked here, before any weight reaches
a GPU slot, and reported as a typed error naming the adapter. Nothing in the files is
skipped silently: a tensor this model cannot apply is an error.
"""

from __future__ import annotations

import json
import math
import re
import reprlib
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import regex
import torch

from loraplex.adapters.experts import ExpertLoRA, ExpertShape, canonical_experts, lora_scaling, owner
from loraplex.adapters.safetensors_io import (
    MAX_HEADER,
    Limits,
    TensorFile,
    TooLarge,
    memory_span,
    read_safetensors,
    tensor_meta,
)
from loraplex.errors import AdapterInvalid, AdapterNotFound, AdapterTooLarge

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# In a content-addressed copy (registry blob, disk-cache entry): its weights were checked
# finite when it was written, so loads skip that pass (older copies lack it: checked).
FINITE_MARK = "loraplex-checked-finite"
_KEY = re.compile(
    r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>A|B|magnitude_vector)(\.weight)?$"
)
MAX_CONFIG_BYTES = 1 << 20  # a LoRA config is a few KB; a larger file is not read
# rank_pattern / alpha_pattern keys are regexes written by the adapter's author, matched
# with `regex`, which releases the GIL and takes a timeout: under `re` a key that
# backtracks exponentially holds the GIL, and with it the engine thread, for hours.
PATTERN_SECONDS = 5.0  # for all of one adapter's pattern keys
_F32_MAX = float(np.finfo(np.float32).max)  # slot copies multiply B by the scaling in float32
_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = 160
shown = _SHOWN.repr  # a value in an error message: long ones cut short, nesting bounded


@dataclass
class LoRAAdapter:
    """One adapter in loraplex's canonical form, in host memory."""

    key: str  # its content id (see manifest.py)
    name: str
    path: str
    rank: int  # the largest rank over its modules
    # Its dense LoRA tensors by name, in the model's dtype, as in the file: a TensorFile
    # (views made on first use) or, after a dtype conversion, a dict.
    tensors: Mapping[str, torch.Tensor]
    # Module path (e.g. "model.layers.0.self_attn.q_proj") -> (name of A [r, in], name of
    # B [out, r], the scaling of B: lora_alpha / r, rsLoRA and patterns folded in; the
    # slot copy multiplies B by it).
    modules: dict[str, tuple[str, str, float]]
    # DoRA: module path -> magnitude vector [out] (float32); empty for plain LoRA.
    magnitudes: dict[str, torch.Tensor] = field(default_factory=dict)
    # MoE: experts module path -> per-expert A/B (adapters/experts.py), model dtype.
    experts: dict[str, ExpertLoRA] = field(default_factory=dict)
    # The pooled page-locked buffer its tensors live in (returned when it leaves host
    # memory), and the event after the last GPU copy from it.
    pinned_buffer: torch.Tensor | None = None
    last_copy: object = None

    @property
    def weights(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Module path -> (A, B) as tensors (B unscaled)."""
        return {m: (self.tensors[a], self.tensors[b]) for m, (a, b, _) in self.modules.items()}

    def shape(self, tensor_name: str) -> tuple[int, ...]:
        t = self.tensors
        return t.entries[tensor_name].shape if isinstance(t, TensorFile) else tuple(t[tensor_name].shape)

    @property
    def nbytes(self) -> int:
        meta = tensor_meta(self.tensors)
        return sum(meta[n][0].itemsize * math.prod(meta[n][1]) for a, b, _ in self.modules.values()
                   for n in (a, b)) + sum(m.nbytes for m in self.magnitudes.values()) + sum(
            t.nbytes for x in self.experts.values() for t in x.tensors())


@dataclass(frozen=True)
class AdapterTargets:
    """What of a model an adapter may target (models/weights.py `adapter_targets`)."""

    projections: Mapping[str, tuple[int, int]]  # module path -> (in_features, out_features)
    experts: Mapping[str, ExpertShape] = field(default_factory=dict)  # experts module path
    renames: Mapping[str, str] = field(default_factory=dict)  # checkpoint path part -> model's
    dora: bool = True  # False: the model is split across ranks, where DoRA's row norms are not
    # The engine's lora_target_modules: names (a path's last part) of the projections and
    # experts it adapts; None: all of them.
    only: tuple[str, ...] | None = None

    def check_adapted(self, adapter: str, module: str) -> None:
        if self.only is not None and module.rpartition(".")[2] not in self.only:
            raise AdapterInvalid(adapter, f"targets {module!r}; this engine adapts only "
                                          f"{', '.join(self.only)} (--lora-target-modules)")

    def max_bytes(self, max_rank: int, itemsize: int) -> int:
        """The most an adapter of rank <= max_rank can hold in this model's dtype."""
        dense = sum(i + o for i, o in self.projections.values())
        experts = sum(x.num_experts * (2 * (x.hidden_size + 2 * x.intermediate_size)
                                       + x.intermediate_size + x.hidden_size)
                      for x in self.experts.values())
        return max_rank * (dense + experts) * itemsize

    @property
    def num_modules(self) -> int:
        """Modules an adapter may name: projections, and per experts module its fused
        parameters (2) or per-expert projections (3 an expert)."""
        return len(self.projections) + sum(3 * x.num_experts + 2 for x in self.experts.values())

    def file_limits(self, max_rank: int) -> Limits:
        """The most a weights file of an adapter of rank <= max_rank holds for this model,
        checked before its data is read: its values (in any dtype; DoRA magnitude vectors
        included) and a header of 3 KiB a module (A, B, magnitude) and 1 MiB of metadata."""
        values = self.max_bytes(max_rank, 1) + sum(o for _, o in self.projections.values())
        return Limits(values, min(MAX_HEADER, (1 << 20) + 3 * 1024 * self.num_modules))


class _Patterns:
    """PEFT's rank_pattern / alpha_pattern: a module takes the value of the first key
    (a regex) that matches a suffix of its path."""

    def __init__(self, name: str, field: str, patterns: Mapping[str, float], targets: AdapterTargets,
                 deadline: float):
        self.name, self.field, self.deadline = name, field, deadline
        if len(patterns) > targets.num_modules + 64:  # more keys than the model has modules
            raise AdapterInvalid(name, f"{field} has {len(patterns)} keys; this model has "
                                       f"{targets.num_modules} modules to adapt")
        self.keys = []
        for key, value in patterns.items():
            try:  # a regex by itself too: "q_proj)(" is one only inside PEFT's wrapper
                regex.compile(key)
                self.keys.append((regex.compile(rf"(.*\.)?({key})$"), value))
            except (regex.error, OverflowError, RecursionError) as e:
                raise AdapterInvalid(name, f"{field} key {shown(key)} is not a regular expression: "
                                           f"{str(e)[:200]}") from None
            self._left()

    def value(self, module: str, default: float) -> float:
        for pattern, value in self.keys:
            try:
                if pattern.match(module, timeout=self._left()):
                    return value
            except TimeoutError:
                raise self._too_slow() from None
        return default

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise self._too_slow()
        return left

    def _too_slow(self) -> AdapterInvalid:
        return AdapterInvalid(self.name, f"{self.field} took over {PATTERN_SECONDS:g} s to match module "
                                         "paths (a key that backtracks?)")


def read_adapter_dir(name: str, path: str | Path, pinned: bool = False,
                     into: torch.Tensor | None = None,
                     limits: Limits | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """The config and tensors of a local PEFT directory, with file-level checks; the
    tensors are views into one buffer holding the weights file (page-locked if `pinned`).
    limits: the most the weights file may hold (AdapterTargets.file_limits), checked
    before its data is read."""
    path = Path(path)
    config_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    try:
        if not config_file.is_file():
            raise AdapterNotFound(name, f"no {CONFIG_FILE} in {shown(str(path))}")
        if not weights_file.is_file():
            if (path / "adapter_model.bin").is_file():
                raise AdapterInvalid(name, "pickled adapter_model.bin is not loaded; save as safetensors")
            raise AdapterNotFound(name, f"no {WEIGHTS_FILE} in {shown(str(path))}")
        with open(config_file, "rb") as f:
            text = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise AdapterInvalid(name, f"cannot read {shown(str(path))}: {reason}") from None
    if len(text) > MAX_CONFIG_BYTES:
        raise AdapterInvalid(name, f"{CONFIG_FILE} is over {MAX_CONFIG_BYTES} bytes; not an adapter config")
    try:
        config = json.loads(text)
    except RecursionError:
        raise AdapterInvalid(name, f"{CONFIG_FILE} is not valid JSON: nested too deeply") from None
    except ValueError as e:  # (JSONDecodeError, bad UTF-8, Python's digit limit)
        raise AdapterInvalid(name, f"{CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise AdapterInvalid(name, f"{CONFIG_FILE} is not a JSON object")
    _check_config(name, config)
    try:
        tensors = read_safetensors(str(weights_file), pinned, into, limits)
    except TooLarge as e:
        raise AdapterTooLarge(name, f"{WEIGHTS_FILE} {e}: more than an adapter of rank <= max_lora_rank "
                                    "holds for this model") from None
    except (OSError, ValueError) as e:
        raise AdapterInvalid(name, f"unreadable {WEIGHTS_FILE}: {e}") from None
    return config, tensors


def to_canonical(
    key: str,
    name: str,
    path: str,
    config: dict,
    tensors: Mapping[str, torch.Tensor],
    targets: AdapterTargets | Mapping[str, tuple[int, int]],
    max_rank: int,
    dtype: torch.dtype,
    check_finite: bool = True,
) -> LoRAAdapter:
    """Validate a PEFT adapter's tensors against the model and work out each module's
    scaling. Dense modules keep the file's tensors (read from a `TensorFile`, no view is
    made here: names, shapes and bytes come from its header and buffer).

    targets: what the model can adapt (a plain mapping: its projections, no experts).
    check_finite=False: the bytes are known finite (a content-addressed copy holding
    FINITE_MARK: checked at registry publish, or by the load before a disk-cache commit),
    so the pass over them is skipped.
    """
    if not isinstance(targets, AdapterTargets):
        targets = AdapterTargets(targets)
    projections = targets.projections
    meta = tensor_meta(tensors)
    halves: dict[str, dict[str, str]] = {}  # module -> "A"/"B"/"m" -> tensor name
    on_experts: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for tensor_name in tensors:
        m = _KEY.match(tensor_name)
        if m is None:
            raise AdapterInvalid(name, f"unsupported tensor {tensor_name!r}")
        module = m["module"]
        for old, new in targets.renames.items():
            module = module.replace(old, new)
        in_experts = owner(module, targets.experts) if module not in projections else None
        if in_experts is not None and m["ab"] in "AB":
            experts_path, rest = in_experts
            targets.check_adapted(name, experts_path)
            on_experts.setdefault(experts_path, {}).setdefault(rest, {})[m["ab"]] = tensors[tensor_name]
            continue
        if module not in projections:
            raise AdapterInvalid(name, f"targets {module!r}, which this model cannot adapt")
        targets.check_adapted(name, module)
        halves.setdefault(module, {})[m["ab"][0]] = tensor_name
    if not halves and not on_experts:
        raise AdapterInvalid(name, f"{WEIGHTS_FILE} holds no LoRA weights")

    use_dora = bool(config.get("use_dora", False))
    deadline = time.monotonic() + PATTERN_SECONDS
    rank_pattern = _Patterns(name, "rank_pattern", config.get("rank_pattern") or {}, targets, deadline)
    alpha_pattern = _Patterns(name, "alpha_pattern", config.get("alpha_pattern") or {}, targets, deadline)

    def scaling_of(module: str, r: int) -> float:
        cfg_r = rank_pattern.value(module, config.get("r", r))
        if cfg_r != r:
            raise AdapterInvalid(name, f"{module}: weights have rank {r}, config says {cfg_r}")
        alpha = alpha_pattern.value(module, config.get("lora_alpha", r))
        scaling = lora_scaling(config, alpha, r)
        if not scaling <= _F32_MAX:  # (alpha and r are finite positive: _check_config)
            raise AdapterInvalid(name, f"{module}: LoRA scaling {scaling:g} (lora_alpha {alpha:g}, r {r}) "
                                       "is past float32's range")
        return scaling

    if on_experts and use_dora:
        raise AdapterInvalid(name, "DoRA on experts is not supported")
    if use_dora and not targets.dora:
        raise AdapterInvalid(name, "DoRA adapters are not served with tensor parallelism")
    raw_expert_tensors = [t for parts in on_experts.values() for ab in parts.values() for t in ab.values()]
    if check_finite and not _all_finite(raw_expert_tensors):
        raise AdapterInvalid(name, "expert LoRA weights have NaN or infinite values")
    experts = canonical_experts(name, config, on_experts, targets.experts, scaling_of, max_rank)
    modules, magnitudes = {}, {}
    for module, ab in sorted(halves.items()):
        if not {"A", "B"} <= set(ab):
            raise AdapterInvalid(name, f"{module} has lora_{''.join(ab)} but not both A and B")
        if ("m" in ab) != use_dora:
            what = "has no" if use_dora else "has a DoRA"
            raise AdapterInvalid(name, f"{module} {what} magnitude vector (use_dora={use_dora})")
        a_shape, b_shape = meta[ab["A"]][1], meta[ab["B"]][1]
        in_f, out_f = projections[module]
        r = a_shape[0] if a_shape else 0
        if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[1] != in_f or b_shape != (out_f, r):
            raise AdapterInvalid(
                name,
                f"{module}: lora_A {a_shape} / lora_B {b_shape} do not fit a {in_f} -> {out_f} projection",
            )
        if r < 1:
            raise AdapterInvalid(name, f"{module}: lora_A {a_shape} has rank 0")
        if r > max_rank:
            raise AdapterTooLarge(name, f"rank {r} of {module} exceeds max_lora_rank={max_rank}")
        modules[module] = (ab["A"], ab["B"], scaling_of(module, r))
        if use_dora:
            # A copy: the file's buffer goes back to the pinned pool when A and B were
            # converted out of it, and a view would then read another adapter's bytes.
            mag = tensors[ab["m"]].to(torch.float32, copy=True).reshape(-1)
            if mag.shape != (out_f,) or not torch.isfinite(mag).all():
                raise AdapterInvalid(name, f"{module}: bad magnitude vector {tuple(mag.shape)}")
            magnitudes[module] = mag.contiguous()
    # The dense kernels bound their loops by this; expert slots have their own capacity.
    rank = max([meta[a][1][0] for a, _, _ in modules.values()]
               + [t.shape[1] for x in experts.values() for t in (x.a_gate_up, x.a_down) if t is not None])
    rank = min(rank, max_rank)
    dense = [n for a, b, _ in modules.values() for n in (a, b)]
    if check_finite and not _all_finite_named(tensors, dense):
        bad = next(m for m, (a, b, _) in modules.items() if not _all_finite_named(tensors, [a, b]))
        raise AdapterInvalid(name, f"{bad} has NaN or infinite weights")
    kept: Mapping[str, torch.Tensor] = tensors if modules else {}
    if any(meta[n][0] != dtype for n in dense):
        kept = dict(zip(dense, _packed([tensors[n] for n in dense], dtype)))
    return LoRAAdapter(key=key, name=name, path=path, rank=rank, tensors=kept, modules=modules,
                       magnitudes=magnitudes, experts=_experts_in(experts, dtype))


def _experts_in(experts: dict[str, ExpertLoRA], dtype: torch.dtype) -> dict[str, ExpertLoRA]:
    """Expert tensors in the model's dtype, in one (page-locked if CUDA) buffer."""
    fields = [(path, i, t) for path, x in experts.items()
              for i, t in enumerate((x.a_gate_up, x.b_gate_up, x.a_down, x.b_down)) if t is not None]
    parts = {path: [None] * 4 for path in experts}
    for (path, i, _), view in zip(fields, _packed([t for _, _, t in fields], dtype)):
        parts[path][i] = view
    return {path: ExpertLoRA(*p) for path, p in parts.items()}


def _packed(tensors: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """Copies of `tensors` in `dtype`, back to back in one (page-locked if CUDA) buffer."""
    buf = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, pin_memory=torch.cuda.is_available())
    out, offset = [], 0
    for t in tensors:
        out.append(buf[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    if out:
        torch._foreach_copy_(out, tensors)
    return out


def all_finite(tensors: Mapping[str, torch.Tensor]) -> bool:
    """Every floating tensor of an adapter file free of NaN and inf."""
    floats = [n for n, (dtype, _) in tensor_meta(tensors).items() if dtype in _NP_FLOATS]
    return _all_finite_named(tensors, floats)


def _all_finite_named(tensors: Mapping[str, torch.Tensor], names: list[str]) -> bool:
    """_all_finite of tensors[name] for `names`; for a TensorFile from the buffer's bytes,
    making no views."""
    if not isinstance(tensors, TensorFile):
        return _all_finite([tensors[n] for n in names])
    spans = [(e.dtype, e.begin, e.end) for e in (tensors.entries[n] for n in names)]
    return all(_finite_bytes(tensors.bytes(begin, end), dtype) for dtype, begin, end in _runs(spans))


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    """No NaN or inf. Tensors back to back in memory (a file read whole) are checked as
    one run per dtype: one pass instead of one per tensor."""
    direct = [t for t in tensors if t.is_contiguous() and t.numel() and t.dtype in _NP_FLOATS]
    spans = [(t.dtype, t.data_ptr(), t.data_ptr() + t.nbytes) for t in direct]
    read = {id(t) for t in direct}
    return all(_finite(t) for t in tensors if id(t) not in read) and all(
        _finite_bytes(np.frombuffer(memory_span(begin, end), np.uint8), dtype)
        for dtype, begin, end in _runs(spans))


def _runs(spans: list[tuple[torch.dtype, int, int]]) -> list[list]:
    """(dtype, begin, end) spans, merged where one ends where the next of its dtype begins."""
    runs: list[list] = []
    for dtype, begin, end in sorted(spans, key=lambda span: span[1]):
        if runs and runs[-1][0] == dtype and runs[-1][2] == begin:
            runs[-1][2] = end
        else:
            runs.append([dtype, begin, end])
    return runs


_CHUNK = 1 << 22  # elements per finiteness check: a small temporary, reused
_INF_BITS = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}  # exponent all ones: inf or NaN


def _finite(t: torch.Tensor) -> bool:
    flat = t.reshape(-1)
    if t.dtype not in _NP_FLOATS:
        flat = flat.float()
    return _finite_bytes(flat.view(torch.uint8).numpy(), flat.dtype)


_NP_FLOATS = {torch.bfloat16: np.int16, torch.float16: np.int16, torch.float32: np.float32,
              torch.float64: np.float64}


def _finite_bytes(raw: np.ndarray, dtype: torch.dtype) -> bool:
    """All finite, checked on the raw bytes in NumPy: one thread, the GIL released (torch
    would spread the check over every core from each loader thread).

    16-bit floats by their exponent bits, all ones meaning inf or NaN: read as int16, a
    positive one is >= those bits; read as uint16, a negative one is >= 0x8000 | bits.
    Two streaming reductions over the bytes, no temporary: loaders run beside the engine
    thread, and every byte they move through memory slows it (a masked copy and its max
    moved three times the adapter's size)."""
    values = raw.view(_NP_FLOATS[dtype])
    if dtype in _INF_BITS:
        bits = _INF_BITS[dtype]
        return values.size == 0 or (int(values.max()) < bits
                                    and int(values.view(np.uint16).max()) < 0x8000 | bits)
    return all(bool(np.isfinite(values[i : i + _CHUNK]).all()) for i in range(0, values.size, _CHUNK))


def _check_config(name: str, config: dict) -> None:
    """The fields that change the arithmetic, typed as PEFT writes them: a value of another
    type (NaN and Infinity parse as floats) would make the model output garbage."""
    def unsupported(what):
        raise AdapterInvalid(name, f"{what} is not supported")

    if config.get("peft_type", "LORA") != "LORA":
        unsupported(f"peft_type {shown(config['peft_type'])}")
    if config.get("modules_to_save"):
        unsupported(f"modules_to_save {shown(config['modules_to_save'])}")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        unsupported("LoRA bias")
    for key, valid, what in (("r", _positive_int, "a positive integer"),
                             ("lora_alpha", _positive_finite, "a finite positive number")):
        value = config.get(key)
        if value is not None and not valid(value):
            raise AdapterInvalid(name, f"{key} must be {what}, got {shown(value)}")
    for key, valid, what in (("rank_pattern", _positive_int, "positive integers"),
                             ("alpha_pattern", _positive_finite, "finite positive numbers")):
        patterns = config.get(key)
        if patterns is None:
            continue
        if not isinstance(patterns, dict):
            raise AdapterInvalid(name, f"{key} must map module patterns to {what}, got a "
                                       f"{type(patterns).__name__}")
        bad = next((k for k, v in patterns.items() if not valid(v)), None)
        if bad is not None:
            raise AdapterInvalid(name, f"{key}[{shown(bad)}] is {shown(patterns[bad])}; "
                                       f"values must be {what}")
    for key in ("use_rslora", "use_dora", "fan_in_fan_out"):
        if config.get(key) is not None and type(config[key]) is not bool:
            raise AdapterInvalid(name, f"{key} must be true or false, got {shown(config[key])}")
    targets = config.get("target_parameters")
    if targets is not None and not (isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
        raise AdapterInvalid(name, f"target_parameters must be a list of names, got {shown(targets)}")


def _positive_int(value) -> bool:
    return type(value) is int and value > 0  # (not True, not 4.0)


def _positive_finite(value) -> bool:
    # Not NaN or inf, and not an integer too large for a float (10**400 written out).
    return type(value) in (int, float) and 0 < value <= sys.float_info.max
