"""Frozen configuration, translated once from Hugging Face configs and user arguments.

Everything downstream reads these dataclasses, never a Hugging Face config or a raw
keyword argument. Validation happens here.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from loraplex.errors import InvalidRequest, UnsupportedModel


@dataclass(frozen=True)
class ArchitectureFacts:
    """What the shared decoder blocks need to know of an architecture that its Hugging
    Face config does not say (models/registry.py holds them, per architecture)."""

    qk_norm: bool
    qkv_bias: bool | None = None  # None: read config.attention_bias
    o_bias: bool | None = None
    moe: bool = False  # sparse MLPs (num_experts, num_experts_per_tok, ...)
    gemma: bool = False  # (1 + w) norms, four per block, scaled embeddings
    sinks: bool = False  # a learned per-head logit in every attention softmax
    norm_topk_prob: bool = False  # for configs that do not say
    activation: str | None = None  # the experts' activation, whatever hidden_act says
    swiglu_limit: float | None = None  # for configs that do not say
    mla: bool = False  # DeepSeek's multi-head latent attention, shared experts
    topk_method: str | None = None  # MoE routing when the config does not say (ROUTINGS)
    renormalize: bool | None = None  # False: routed weights never renormalised, whatever it says


# Stop strings loraplex reads from a model's generation_config.json beside transformers'
# own "stop_strings" (which makes a plain transformers generate() without a tokenizer raise).
STOP_STRINGS_KEY = "loraplex_stop_strings"
_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
QUANTIZATION_METHODS = ("mxfp4", "fp8", "compressed-tensors", "awq", "gptq")
# FP8 activations (--fp8-activations): left in the model's dtype; e4m3 at run time (W8A8)
# in every GEMM; or e4m3 only in GEMMs of at least W8A8_PREFILL_MIN_TOKENS rows.
FP8_ACTIVATIONS = ("unquantized", "dynamic", "prefill")
# "prefill": where W8A8 starts. Below it (decode steps) a GEMM is bound by the weight's
# bytes, which the e4m3 MMA does not shrink, while quantizing the rows costs a launch
# per GEMM, and the experts' GEMV form (weight-only) expands adapters from shrunk rows;
# from here on e4m3 x e4m3 is the faster form (Qwen3-30B-A3B's expert layer on an H100:
# 208 vs 217 us at 32 tokens, 243 vs 236 at 64, 393 vs 295 at 512).
W8A8_PREFILL_MIN_TOKENS = 64


@dataclass(frozen=True)
class QuantConfig:
    """How a checkpoint's weights are quantized (its quantization_config), or that a
    bf16 checkpoint is quantized as it loads (`--quantization fp8`). Every layer not
    skipped holds its weight in `format` (ops/formats); models/quant.py converts the
    checkpoint's tensors to it."""

    method: str  # a QUANTIZATION_METHODS entry
    format: str  # "fp8", "int4" or "mxfp4"
    # fp8: the [N, K] block one scale covers ((1, K): per channel; (N, K): per tensor,
    # with N, K of 0 for "the whole dimension").
    weight_block: tuple[int, int] | None = None
    group_size: int = 0  # int4: K values per scale and zero point
    symmetric: bool = True  # int4: zero point 8 (GPTQ sym); AWQ and GPTQ asym store theirs
    checkpoint_format: str = ""  # gptq: "gptq" (zero points stored minus one) or "gptq_v2"
    skip: tuple[str, ...] = ()  # module path patterns (fnmatch) left unquantized
    online: bool = False  # quantized from a bf16 checkpoint at load
    # fp8: activations quantized per token and this many columns at run time (W8A8:
    # Fp8Weight.act_block, `with_dynamic_activations`), or 0 (weight-only, the default);
    # in GEMMs of at least act_min_tokens rows (Fp8Weight.act_min_tokens).
    act_block: int = 0
    act_min_tokens: int = 0

    @classmethod
    def requested(cls, method: str, online: bool) -> QuantConfig:
        """`--quantization METHOD` without a checkpoint quantized so: random weights in the
        method's format (its usual coverage: MXFP4 on experts, int4 on dense projections,
        fp8 on both), or (online) a bf16 checkpoint quantized as it loads. FP8 per row and
        128 columns; int4 groups of 128, symmetric for GPTQ."""
        formats = {"fp8": "fp8", "compressed-tensors": "fp8", "mxfp4": "mxfp4", "awq": "int4", "gptq": "int4"}
        return cls(method, formats[method], weight_block=(1, 128), group_size=128, symmetric=method == "gptq",
                   online=online)

    def with_dynamic_activations(self, min_tokens: int = 0) -> QuantConfig:
        """This FP8 quantization with its activations quantized at run time, as block-
        scaled checkpoints' activation_scheme "dynamic" asks (and vLLM runs them): e4m3
        per token and weight_block[1] columns (W8A8), in GEMMs of at least min_tokens
        rows (fewer: weight-only). Block-scaled FP8 only, with K
        blocks of a power of two of 32 or more (the kernels' K steps lie in one block of
        both scales); anything else is an UnsupportedModel naming why."""
        block = self.weight_block[1] if self.weight_block else 0
        if self.method != "fp8" or block < 32 or block & (block - 1):
            what = (f"{self.method} weights" if self.method != "fp8"
                    else f"FP8 blocks {list(self.weight_block)} (K blocks of a power of two, >= 32, needed)")
            raise UnsupportedModel(f"dynamic FP8 activations (W8A8) apply to block-scaled FP8 weights, "
                                   f"not to {what}")
        return replace(self, act_block=block, act_min_tokens=min_tokens)

    @classmethod
    def from_hf(cls, arch: str, q: dict) -> QuantConfig:
        """A Hugging Face quantization_config; anything else loraplex cannot serve exactly
        is an UnsupportedModel naming the variant."""
        method = q.get("quant_method")

        def unsupported(what: str):
            raise UnsupportedModel(f"{arch}: {method} checkpoints with {what} are not supported")

        skip = tuple(q.get("modules_to_not_convert") or q.get("ignore") or ())
        if method == "mxfp4":
            return cls(method, "mxfp4", skip=skip)
        if method == "fp8":
            if q.get("fmt", "e4m3") != "e4m3":
                unsupported(f"fmt {q.get('fmt')!r}")
            if q.get("activation_scheme", "dynamic") != "dynamic":
                unsupported(f"activation_scheme {q.get('activation_scheme')!r}")
            block = q.get("weight_block_size")
            if not (isinstance(block, list) and len(block) == 2
                    and all(isinstance(b, int) and b > 0 for b in block)):
                unsupported(f"weight_block_size {block!r} (a [N, K] block is required)")
            # activation_scheme "dynamic": served weight-only unless asked
            # (with_dynamic_activations, --fp8-activations dynamic).
            return cls(method, "fp8", weight_block=tuple(block), skip=skip)
        if method == "compressed-tensors":
            # llm-compressor's FP8 checkpoints (format float-quantized: e4m3 `weight` [N, K]
            # and `weight_scale` [N, 1] per channel or [1] per tensor, W = weight * scale).
            # Their dynamic activation quantization (e4m3 per token at run time) is not
            # applied: ops.linear reads the weight dequantized and leaves activations be.
            groups = q.get("config_groups") or {}
            if len(groups) != 1:
                unsupported(f"{len(groups)} config groups")
            [(group_name, group)] = groups.items()
            if not isinstance(group, dict):  # a preset's name mapped to its targets
                unsupported(f"the preset scheme {group_name!r}")
            fmt = group.get("format") or q.get("format")
            if fmt not in ("float-quantized", "naive-quantized"):
                unsupported(f"format {fmt!r} (FP8 float-quantized only)")
            weights, inputs = group.get("weights") or {}, group.get("input_activations")
            if weights.get("type") != "float" or weights.get("num_bits") != 8:
                unsupported(f"weights {weights.get('type')} of {weights.get('num_bits')} bits")
            if weights.get("strategy") not in ("channel", "tensor") or weights.get("dynamic"):
                unsupported(f"weight strategy {weights.get('strategy')!r}"
                            + (" (dynamic)" if weights.get("dynamic") else ""))
            if not weights.get("symmetric", True):
                unsupported("asymmetric weights (zero points)")
            if weights.get("actorder"):
                unsupported(f"actorder {weights.get('actorder')!r}")
            if inputs is not None and inputs.get("dynamic") is not True:
                unsupported("static activation scales")
            if group.get("output_activations") is not None:
                unsupported("output activation quantization")
            if q.get("kv_cache_scheme") is not None:
                unsupported("kv_cache_scheme (a quantized KV cache)")
            if q.get("transform_config"):
                unsupported("transform_config (rotated weights)")
            if (q.get("sparsity_config") or {}).get("format", "dense") != "dense":
                unsupported(f"sparsity format {q['sparsity_config'].get('format')!r}")
            block = (1, 0) if weights["strategy"] == "channel" else (0, 0)
            return cls(method, "fp8", weight_block=block, skip=skip)
        if method in ("awq", "gptq"):
            bits, group = q.get("bits", q.get("w_bit")), q.get("group_size", q.get("q_group_size"))
            if bits != 4:
                unsupported(f"{bits} bits")
            if not isinstance(group, int) or group <= 0 or group % 2:
                unsupported(f"group_size {group!r}")
            if method == "awq":
                if str(q.get("version", "gemm")).lower() != "gemm":
                    unsupported(f"version {q.get('version')!r} (GEMM packing only)")
                return cls(method, "int4", group_size=group, symmetric=not q.get("zero_point", True),
                           skip=skip)
            if q.get("desc_act"):
                unsupported("desc_act (act-order)")
            fmt = q.get("checkpoint_format", "gptq")
            if fmt not in ("gptq", "gptq_v2"):
                unsupported(f"checkpoint_format {fmt!r}")
            return cls(method, "int4", group_size=group, symmetric=bool(q.get("sym", True)),
                       checkpoint_format=fmt, skip=skip)
        raise UnsupportedModel(f"{arch}: quantization {method!r} is not supported; "
                               f"supported: {', '.join(QUANTIZATION_METHODS)}")
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# MoE routing (DeepSeek's names): softmax top-k; softmax, top-k within the topk_group groups
# of the highest expert score; sigmoid scores plus a correction bias choose within the
# groups of the highest top-2 sums, the scores without the bias weigh (DeepSeek-V3).
ROUTINGS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek's multi-head latent attention: keys and values of every head come from
    one compressed latent (kv_lora_rank values, RMS-normed) through kv_b_proj, and one
    rotary key of qk_rope_head_dim is shared by the heads; the cache holds those two
    (layers/mla.py)."""

    q_lora_rank: int | None  # None: q_proj; else q_a_proj -> norm -> q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    scale: float  # the softmax scale: (nope + rope)^-0.5, YaRN's mscale_all_dim squared
    rope_interleave: bool = True  # the rotary dims rotate as (x0, x1), (x2, x3), ... pairs

    @property
    def cache_dim(self) -> int:
        """Values a token keeps per layer: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, arch: str, hf, rope: dict) -> MLAConfig:
        if getattr(hf, "attention_bias", False):
            raise UnsupportedModel(f"{arch}: attention_bias with latent attention is not supported")
        qk = hf.qk_nope_head_dim + hf.qk_rope_head_dim
        return cls(hf.q_lora_rank, hf.kv_lora_rank, hf.qk_nope_head_dim, hf.qk_rope_head_dim,
                   hf.v_head_dim, qk**-0.5 * _softmax_mscale(rope) ** 2,
                   bool(getattr(hf, "rope_interleave", True)))


def _routing(arch: str, hf, facts: ArchitectureFacts, experts: int) -> dict:
    method = facts.topk_method or getattr(hf, "topk_method", None) or "greedy"
    if method not in ROUTINGS:
        raise UnsupportedModel(f"{arch}: topk_method {method!r} is not supported; "
                               f"supported: {', '.join(ROUTINGS)}")
    scoring = "sigmoid" if method == "noaux_tc" else "softmax"
    if (getattr(hf, "scoring_func", None) or scoring) != scoring:
        raise UnsupportedModel(f"{arch}: scoring_func {hf.scoring_func!r} with topk_method {method!r}")
    if method == "greedy":
        return {}
    groups, chosen = getattr(hf, "n_group", None) or 1, getattr(hf, "topk_group", None) or 1
    if experts % groups or not 0 < chosen <= groups:
        raise UnsupportedModel(f"{arch}: n_group {groups} and topk_group {chosen} do not group "
                               f"{experts} experts")
    return dict(topk_method=method, num_expert_groups=groups, topk_group=chosen)


def _softmax_mscale(rope: dict) -> float:
    """DeepSeek's YaRN also scales the softmax: by 0.1 m ln(factor) + 1 squared, m its
    mscale_all_dim (transformers' yarn_get_mscale)."""
    m = rope.get("mscale_all_dim")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default" or not m or rope.get("factor", 1) <= 1:
        return 1.0
    return 0.1 * m * math.log(rope["factor"]) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    # Layer type ("full_attention", "sliding_attention") -> Hugging Face rope parameters
    # (rope_theta, rope_type and its scaling fields).
    rope: dict[str, dict[str, Any]]
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    # Per layer: "full_attention" or "sliding_attention".
    layer_types: tuple[str, ...]
    sliding_window: int | None
    dtype: str  # the checkpoint's dtype name, e.g. "bfloat16"
    initializer_range: float
    eos_token_ids: tuple[int, ...] = ()
    activation: str = "silu"  # gated MLP activation: "silu" or "gelu_tanh"
    attn_scale: float | None = None  # None: head_dim ** -0.5
    # Gemma: norms scale by (1 + w) in float32; each block also normalises the outputs
    # of attention and MLP; embeddings are multiplied by sqrt(hidden_size).
    gemma_norms: bool = False
    embed_scale: float | None = None
    final_logit_softcap: float | None = None
    # Mixture of experts: layers whose MLP is sparse, and its shape.
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    swiglu_limit: float | None = None  # activation "swiglu_oai" (gpt-oss) clamps at this
    # gpt-oss: a learned logit per query head that joins every softmax denominator
    # (attention may go "nowhere"); checkpoints hold it as self_attn.sinks [num_heads].
    attention_sinks: bool = False
    quant: QuantConfig | None = None  # None: the checkpoint's own dtype throughout
    mla: MLAConfig | None = None  # DeepSeek's latent attention (its KV cache is the latent)
    # DeepSeek MoE: an MLP of num_shared_experts x moe_intermediate_size beside the routed
    # experts, whose weights are multiplied by routed_scaling_factor.
    num_shared_experts: int = 0
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"  # a ROUTINGS entry; the grouped ones choose among groups:
    num_expert_groups: int = 1
    topk_group: int = 1

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_window(self, layer: int) -> int | None:
        """Sliding window of `layer` in tokens (keys with pos > q_pos - window), or None."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @classmethod
    def from_hf(cls, hf, arch: str, facts: ArchitectureFacts) -> ModelConfig:
        """Translate a transformers PretrainedConfig (transformers >= 5) of architecture
        `arch` (models.registry.model_config finds it and its facts)."""
        act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu")
        if facts.activation is None and act not in _ACTIVATIONS:
            raise UnsupportedModel(f"{arch}: activation {act!r} is not supported")
        if getattr(hf, "attn_logit_softcapping", None) is not None:
            raise UnsupportedModel(f"{arch}: attention logit soft-capping is not supported")
        quant = getattr(hf, "quantization_config", None)
        if quant is not None and not isinstance(quant, dict):
            quant = quant.to_dict()
        quant = QuantConfig.from_hf(arch, quant) if quant else None
        if getattr(hf, "swiglu_alpha", 1.702) != 1.702:  # the constant ops use for swiglu_oai
            raise UnsupportedModel(f"{arch}: swiglu_alpha {hf.swiglu_alpha} is not supported")
        attention_bias = bool(getattr(hf, "attention_bias", False))
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        n_layers = hf.num_hidden_layers
        window = getattr(hf, "sliding_window", None)
        layer_types = getattr(hf, "layer_types", None)
        if layer_types is None:
            kind = "sliding_attention" if window is not None else "full_attention"
            layer_types = [kind] * n_layers
        if "sliding_attention" not in layer_types:
            window = None
        rope = _rope_by_layer_type(arch, hf, set(layer_types))
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None) or "bfloat16"
        gemma = facts.gemma
        pre_attn_scalar = getattr(hf, "query_pre_attn_scalar", None)
        moe = {}
        if facts.moe:
            experts = getattr(hf, "num_experts", None) or hf.num_local_experts  # Mixtral's name
            step = getattr(hf, "decoder_sparse_step", 1)
            dense = set(getattr(hf, "mlp_only_layers", None) or [])
            dense |= set(range(getattr(hf, "first_k_dense_replace", 0)))  # DeepSeek
            moe = dict(
                moe_layers=tuple(i for i in range(n_layers)
                                 if experts > 0 and i not in dense and (i + 1) % step == 0),
                num_experts=experts, num_experts_per_tok=hf.num_experts_per_tok,
                moe_intermediate_size=getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size,
                norm_topk_prob=bool(getattr(hf, "norm_topk_prob", facts.norm_topk_prob))
                if facts.renormalize is None else facts.renormalize,
                swiglu_limit=getattr(hf, "swiglu_limit", facts.swiglu_limit),
                num_shared_experts=getattr(hf, "n_shared_experts", None) or 0,
                routed_scaling_factor=float(getattr(hf, "routed_scaling_factor", 1.0)),
                **_routing(arch, hf, facts, experts),
            )
        return cls(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=n_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings,
            rope=rope,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=attention_bias if facts.qkv_bias is None else facts.qkv_bias,
            o_bias=attention_bias if facts.o_bias is None else facts.o_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=facts.qk_norm,
            layer_types=tuple(layer_types),
            sliding_window=window,
            dtype=str(dtype).removeprefix("torch."),
            initializer_range=float(getattr(hf, "initializer_range", 0.02)),
            eos_token_ids=eos_ids,
            activation=facts.activation or _ACTIVATIONS[act],
            attn_scale=pre_attn_scalar**-0.5 if pre_attn_scalar else None,
            gemma_norms=gemma,
            embed_scale=hf.hidden_size**0.5 if gemma else None,
            final_logit_softcap=getattr(hf, "final_logit_softcapping", None),
            attention_sinks=facts.sinks,
            quant=quant,
            mla=MLAConfig.from_hf(arch, hf, rope["full_attention"]) if facts.mla else None,
            **moe,
        )


def _rope_by_layer_type(arch: str, hf, layer_types: set[str]) -> dict[str, dict[str, Any]]:
    """rope_parameters is one dict, or (Gemma 3) one dict per layer type."""
    params = dict(getattr(hf, "rope_parameters", None) or {})
    if not layer_types <= params.keys():
        params = {t: params for t in layer_types}
    out = {}
    for layer_type in layer_types:
        rope = dict(params[layer_type])
        rope.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in _ROPE_TYPES:
            raise UnsupportedModel(f"{arch}: rope_type {kind!r} is not supported")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedModel(f"{arch}: partial rotary embeddings are not supported")
        if kind == "yarn" and rope.get("factor") is None:  # as transformers infers it
            rope["factor"] = hf.max_position_embeddings / rope["original_max_position_embeddings"]
        out[layer_type] = rope
    return out


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Fraction of GPU memory loraplex may use (weights + activations + KV cache).
    gpu_memory_utilization: float = 0.9
    # Exact number of KV blocks; overrides the memory-based sizing (tests, debugging).
    num_gpu_blocks_override: int | None = None
    # KV cache budget on CPU, where there is no memory to profile.
    cpu_kv_cache_bytes: int = 4 << 30
    # Full pages are kept and reused by later requests with the same prefix, adapter
    # content and salt (engine/block_manager.py).
    enable_prefix_caching: bool = True

    def __post_init__(self):
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")


@dataclass(frozen=True)
class LoRAConfig:
    # GPU slots: adapters that can be in one batch at once.
    max_loras: int = 8
    max_lora_rank: int = 64
    # Adapters kept loaded in host memory (None: 4 x max_loras), and optionally a byte
    # budget for them.
    max_cpu_loras: int | None = None
    max_cpu_lora_bytes: int | None = None
    # Registry of named, versioned adapters (a directory or fsspec URL), for requests
    # that give a name (name@version) and no path.
    registry: str | None = None
    # Downloaded (remote) adapters, by content id, on local disk.
    disk_cache_dir: str | None = None  # None: $LORAPLEX_CACHE/adapters
    disk_cache_bytes: int = 32 << 30
    load_workers: int = 4  # threads reading adapters
    load_timeout: float = 120.0  # seconds before a load counts as failed (hung source)
    # Module names (q_proj, gate, kv_b_proj, ...; `experts` for routed experts) that get
    # adapter slots; None: every one the model has. A projection left out costs nothing
    # in a step, and adapters that target it are refused.
    target_modules: tuple[str, ...] | None = None

    def __post_init__(self):
        if self.max_loras < 0 or self.max_lora_rank <= 0:
            raise ValueError("max_loras must be >= 0 and max_lora_rank > 0")
        if self.target_modules is not None:
            if isinstance(self.target_modules, str):  # tuple() would split it into letters
                raise ValueError(f"lora_target_modules must be a list of module names, got "
                                 f"{self.target_modules!r}")
            object.__setattr__(self, "target_modules", tuple(self.target_modules))  # (frozen)
            if not self.target_modules or not all(isinstance(m, str) and m for m in self.target_modules):
                raise ValueError("lora_target_modules must be a non-empty list of module names")

    @property
    def enabled(self) -> bool:
        return self.max_loras > 0

    @property
    def host_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else 4 * max(1, self.max_loras)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    # Waiting requests whose adapter cannot get a GPU slot are passed over for ones that
    # can run now, until the oldest has waited this long; then only requests that need
    # no slot are admitted until it gets one.
    max_adapter_wait: float = 2.0

    def __post_init__(self):
        if min(self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len) <= 0:
            raise ValueError("max_num_seqs, max_num_batched_tokens, max_model_len must be > 0")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Every running request's decode token must fit one step (async scheduling
            # feeds an in-flight token only to the very next step).
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")


CUDAGRAPH_MODES = ("FULL", "FULL_DECODE_ONLY", "NONE")


SPECULATIVE_METHODS = ("ngram", "draft_model")


# Proposed tokens per step, over all requests: past it, large batches verify less (a
# step of many sequences is no longer bound by reading the weights, and each verified
# token costs nearly as much as a decoded one).
DRAFT_TOKENS_PER_STEP = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's --speculative-config): each step proposes up to
    num_speculative_tokens tokens per decoding sequence and verifies them in one forward
    (engine/speculative.py, runner/rejection.py)."""

    method: str = "ngram"  # or "draft_model" (engine/draft_model.py)
    num_speculative_tokens: int = 3  # k: proposed tokens per sequence per step
    prompt_lookup_max: int = 4  # ngram: longest suffix searched for
    prompt_lookup_min: int = 1  # ngram: shortest
    # No proposals while more requests than this are running: a large batch is compute-
    # bound, where each verified token costs nearly what a decoded one does.
    disable_by_batch_size: int | None = None
    model: str | None = None  # draft_model: the draft's model directory (same vocabulary)
    # draft_model: adapter name -> the draft model's adapter for requests naming it (else
    # an adapter directory's draft/ subdirectory, else the draft runs bare).
    draft_adapters: tuple[tuple[str, str], ...] = ()

    def max_step_tokens(self, num_seqs: int) -> int:
        """The most tokens a step of num_seqs decoding sequences verifies: a token each
        and their proposals, at most DRAFT_TOKENS_PER_STEP of them."""
        return num_seqs + min(num_seqs * self.num_speculative_tokens, DRAFT_TOKENS_PER_STEP)

    @classmethod
    def parse(cls, spec: str | dict | None) -> SpeculativeConfig | None:
        """From vLLM's JSON (a string or a dict); None or {} is no speculation. Unknown
        keys and methods are errors, never ignored."""
        if spec is None or spec == "" or spec == {}:
            return None
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise InvalidRequest(f"speculative config is not JSON: {e}") from e
        if not isinstance(spec, dict):
            raise InvalidRequest("speculative config must be a JSON object")
        counts = ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size")
        fields = {"method", "model", "draft_adapters", *counts}
        unknown = sorted(set(spec) - fields)
        if unknown:
            raise InvalidRequest(f"speculative config: unsupported keys {unknown} "
                                 f"(supported: {sorted(fields)})")
        method = spec.get("method", "draft_model" if "model" in spec else "ngram")
        if method not in SPECULATIVE_METHODS:
            raise InvalidRequest(f"speculative config: method {method!r} is not supported "
                                 f"(supported: {SPECULATIVE_METHODS})")
        if method == "draft_model":
            if not isinstance(spec.get("model"), str) or not spec["model"]:
                raise InvalidRequest("speculative config: draft_model needs \"model\": a model directory")
            lookup = sorted({"prompt_lookup_max", "prompt_lookup_min"} & set(spec))
            if lookup:
                raise InvalidRequest(f"speculative config: {lookup} apply to ngram, not draft_model")
        else:
            for key in sorted({"model", "draft_adapters"} & set(spec)):
                raise InvalidRequest(f"speculative config: \"{key}\" applies to draft_model, not {method}")
        adapters = spec.get("draft_adapters", {})
        if not isinstance(adapters, dict) or not all(isinstance(k, str) and isinstance(v, str) and v
                                                     for k, v in adapters.items()):
            raise InvalidRequest("speculative config: draft_adapters maps adapter names to directories")
        if "num_speculative_tokens" not in spec:
            raise InvalidRequest("speculative config: num_speculative_tokens is required")
        values = {}
        for key in counts:
            if key in spec:
                v = spec[key]
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise InvalidRequest(f"speculative config: {key} must be a positive integer, got {v!r}")
                values[key] = v
        config = cls(method=method, model=spec.get("model"), draft_adapters=tuple(sorted(adapters.items())),
                     **values)
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise InvalidRequest("speculative config: prompt_lookup_min exceeds prompt_lookup_max")
        return config


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    model: ModelConfig
    dtype: str  # resolved torch dtype name the model runs in
    device: str
    seed: int
    load_format: str  # "auto" (safetensors) or "dummy" (random weights)
    ops_backend: str = "torch"  # "torch" (reference ops) or "triton" (kernels)
    # Which steps replay CUDA graphs (vLLM's names): "FULL" decode steps and mixed steps
    # of up to max_cudagraph_capture_size tokens, "FULL_DECODE_ONLY" decode steps, "NONE"
    # (what LLM(enforce_eager=True) asks for).
    cudagraph_mode: str = "FULL"
    max_cudagraph_capture_size: int = 2048
    # MoE: count the distinct experts each decode step routes to (benchmarks; costs a few
    # small kernels per layer).
    measure_moe_routing: bool = False
    cache: CacheConfig = field(default_factory=CacheConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None
    # Ranks the model is split across (runner/tensor_parallel.py): GPUs 0..N-1, or gloo
    # processes on CPU.
    tensor_parallel_size: int = 1

    def __post_init__(self):
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(f"cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)}, "
                             f"got {self.cudagraph_mode!r}")
        if self.max_cudagraph_capture_size <= 0:
            raise ValueError("max_cudagraph_capture_size must be > 0")

    @property
    def max_blocks_per_seq(self) -> int:
        return math.ceil(self.scheduler.max_model_len / self.cache.block_size)


def cache_root() -> Path:
    """Where loraplex keeps what it downloads or builds: $LORAPLEX_CACHE, else
    ~/.cache/loraplex."""
    return Path(os.environ.get("LORAPLEX_CACHE", Path.home() / ".cache" / "loraplex"))
