"""Engine arguments, declared once: `LLM(...)`'s keyword arguments and the engine flags
of `loraplex serve`, `bench` and `generate`, with vLLM's names.

Each field's metadata holds its help and argparse form, so a flag exists on every
command or on none; a command that wants another default says so with
parser.set_defaults. `create_engine_config()` reads the model directory and resolves the
"auto" values into the frozen EngineConfig; `create_engine()` builds the LLMEngine.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch
from transformers import AutoConfig

from loraplex.config import (
    CUDAGRAPH_MODES,
    FP8_ACTIVATIONS,
    QUANTIZATION_METHODS,
    STOP_STRINGS_KEY,
    W8A8_PREFILL_MIN_TOKENS,
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    QuantConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from loraplex.engine.engine import LLMEngine
from loraplex.engine.tokenizer import load_tokenizer
from loraplex.errors import ModelLoadError, UnsupportedModel
from loraplex.models.registry import model_config
from loraplex.models.tensor_parallel import shard_config

DTYPES = {
    "float32": "float32", "float": "float32", "fp32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "half": "float16", "fp16": "float16",
}
LOAD_FORMATS = ("auto", "safetensors", "dummy")
OPS_BACKENDS = ("auto", "torch", "triton")
ENGINE_GROUP = "engine arguments"


def at_least(minimum: int):
    """An argparse type: an integer >= minimum (a zero or negative count would fail deep
    inside a run, or hang it)."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in "invalid int value: ..."
    return parse


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _gib_to_bytes(text: str) -> int:
    """GiB on the command line, bytes in EngineArgs (tests budget a few MiB)."""
    gib = float(text)
    if not gib > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return int(gib * 2**30)


_fraction.__name__ = _gib_to_bytes.__name__ = "float"


def _option(default, help: str, flag: str | None = None, **argparse_kwargs):
    """A field and its command line: the flag (default: --field-name), its help, and
    argparse's other keywords (type or action, choices, metavar)."""
    return field(default=default, metadata={"help": help, "flag": flag, "argparse": argparse_kwargs})


@dataclass
class EngineArgs:
    # Each command declares its model argument itself: serve's is optional (the default
    # model), bench's may name a bundled config.
    model: str
    tokenizer: str | None = _option(None, "tokenizer directory; None: the model's", metavar="DIR")
    dtype: str | torch.dtype = _option(
        "auto", "dtype the model runs in; auto: the checkpoint's on a GPU, float32 on CPU (where "
        "bf16 matmuls are slow)", choices=["auto", *DTYPES])
    device: str | None = _option(None, "cuda or cpu; None: cuda when there is one")
    seed: int = _option(0, "seed of dummy weights and of unseeded requests' draws", type=int)
    load_format: str = _option(
        "auto", "auto / safetensors: the model directory's weights; dummy: random weights of "
        "its config's shapes", choices=LOAD_FORMATS)
    quantization: str | None = _option(
        None, "fp8: quantize a bf16 checkpoint's linear weights as it loads (block-scaled e4m3); "
        "with load_format dummy, any method (mxfp4, fp8, awq, gptq) gives random weights in that "
        "format; a quantized checkpoint says its own method", choices=QUANTIZATION_METHODS)
    fp8_activations: str = _option(
        "unquantized", "FP8 block-scaled checkpoints and --quantization fp8: unquantized keeps "
        "activations in the model's dtype (weight-only GEMMs, the more exact); dynamic quantizes "
        "them to e4m3 per token and 128 columns at run time, as the checkpoints' activation_scheme "
        "asks and vLLM runs them (W8A8: e4m3 x e4m3 on the tensor cores); prefill quantizes them in "
        f"steps of {W8A8_PREFILL_MIN_TOKENS} tokens or more, where e4m3 MMAs are the faster form, "
        "and leaves decode steps' (bound by the weights' bytes) in the model's dtype",
        choices=FP8_ACTIVATIONS)
    speculative_config: str | dict | None = _option(
        None, "speculative decoding, vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": "
        "k, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 1}, or a draft model of the same "
        "vocabulary: {\"model\": DIR, \"num_speculative_tokens\": k}; each decoding sequence "
        "verifies up to k proposed tokens a step", metavar="JSON")
    enable_prefix_caching: bool = _option(
        True, "keep full KV pages and reuse them for later requests with the same prefix, "
        "adapter content and salt", action=argparse.BooleanOptionalAction)
    enable_lora: bool = _option(
        True, "accepted for vLLM's command lines: adapters are on unless --max-loras 0 "
        "(LLM(enable_lora=False) is max_loras=0)", action="store_true")
    max_loras: int = _option(8, "GPU adapter slots: distinct adapters in one step; 0 turns "
                             "adapters off", type=at_least(0))
    max_lora_rank: int = _option(64, "largest adapter rank served", type=at_least(1))
    lora_target_modules: list[str] | None = _option(
        None, "only these modules get adapter slots (names as in the checkpoint: q_proj, "
        "o_proj, gate_proj, ...; `experts` for routed experts); the others cost nothing in a "
        "step, and adapters that target them are refused. None: every projection and expert",
        nargs="+", metavar="MODULE")
    max_cpu_loras: int | None = _option(None, "adapters kept in host memory; None: 4 x "
                                        "max-loras", type=at_least(1))
    max_cpu_lora_bytes: int | None = _option(
        None, "byte budget of the host adapter tier besides --max-cpu-loras, page-locked at "
        "start: GiB here, bytes in LLM(max_cpu_lora_bytes=...)", flag="--max-cpu-lora-memory",
        type=_gib_to_bytes, metavar="GIB")
    lora_registry: str | None = _option(
        None, "registry of named, versioned adapters: requests may name `name[@version]`",
        metavar="DIR_OR_URL")
    lora_cache_dir: str | None = _option(
        None, "local disk cache of downloaded adapters; None: $LORAPLEX_CACHE/adapters", metavar="DIR")
    lora_load_workers: int = _option(4, "threads that load adapters", type=at_least(1))
    lora_load_timeout: float = _option(
        120.0, "seconds before an adapter that has not loaded fails its requests", type=float)
    tensor_parallel_size: int = _option(
        1, "split the model across this many GPUs of the host (one process each; gloo "
        "processes on CPU)", type=at_least(1))
    max_num_seqs: int = _option(256, "most sequences in one step", type=at_least(1))
    max_num_batched_tokens: int | None = _option(
        None, "most tokens in one step; None: max(8192, max-num-seqs)", type=at_least(1))
    max_model_len: int | None = _option(
        None, "longest sequence, prompt and output; None: the model's max_position_embeddings",
        type=at_least(1))
    block_size: int = _option(16, "tokens per KV cache page (a power of two)", type=at_least(1))
    gpu_memory_utilization: float = _option(
        0.9, "fraction of GPU memory for weights, activations and KV cache", type=_fraction)
    num_gpu_blocks_override: int | None = _option(
        None, "KV cache pages, instead of sizing them by memory", type=at_least(1))
    max_logprobs: int = _option(20, "most logprobs a request may ask for", type=at_least(0))
    ops_backend: str = _option(
        "auto", "triton kernels or the plain-torch reference ops; auto: triton on a GPU",
        choices=OPS_BACKENDS)
    enforce_eager: bool = _option(False, "replay no step from CUDA graphs", action="store_true")
    cudagraph_mode: str = _option(
        "FULL", "steps replayed from CUDA graphs: decode and mixed steps, decode only, none",
        choices=CUDAGRAPH_MODES)
    max_cudagraph_capture_size: int = _option(
        2048, "the largest mixed step (tokens) replayed from a CUDA graph", type=at_least(1))
    async_scheduling: bool = _option(
        True, "plan and launch each step before reading the previous one's tokens (host work "
        "hidden behind the device's)", action=argparse.BooleanOptionalAction)
    measure_moe_routing: bool = _option(
        False, "MoE: count the distinct experts each decode step routes to (a few small "
        "kernels per layer)", action=argparse.BooleanOptionalAction)

    @staticmethod
    def flag(f) -> str:
        """A field's flag: vLLM's name, --field-name, unless the field names another."""
        return f.metadata["flag"] or "--" + f.name.replace("_", "-")

    @classmethod
    def cli_fields(cls) -> list:
        """Every field but model, which each command declares itself."""
        return [f for f in fields(cls) if "help" in f.metadata]

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        group = parser.add_argument_group(
            ENGINE_GROUP, "the same on serve, bench and generate; LLM()'s keyword arguments")
        for f in cls.cli_fields():
            group.add_argument(cls.flag(f), dest=f.name, default=f.default,
                               help=f.metadata["help"] + " (default: %(default)s)",
                               **f.metadata["argparse"])
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def create_engine_config(self) -> EngineConfig:
        """The frozen config: the model directory's configs read once, "auto" and None
        values resolved."""
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, "
                             f"got {self.load_format!r}")
        if not (Path(self.model) / "config.json").is_file():  # else transformers takes it for a Hub id
            raise ModelLoadError(f"{self.model}: not a model directory (no config.json)")
        model_cfg = model_config(AutoConfig.from_pretrained(self.model))
        model_cfg = replace(model_cfg, quant=self._quantization(model_cfg.quant))
        model_cfg = replace(model_cfg, eos_token_ids=tuple(sorted(
            {*model_cfg.eos_token_ids, *_generation_config(self.model)["eos"]})))
        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        speculative = SpeculativeConfig.parse(self.speculative_config)
        self._check_tensor_parallel(model_cfg, device, speculative)
        return EngineConfig(
            model_path=str(self.model),
            model=model_cfg,
            dtype=_resolve_dtype(self.dtype, model_cfg.dtype, device),
            device=device,
            seed=self.seed,
            load_format="dummy" if self.load_format == "dummy" else "auto",
            ops_backend=_resolve_backend(self.ops_backend, device),
            cudagraph_mode="NONE" if self.enforce_eager else self.cudagraph_mode,
            max_cudagraph_capture_size=self.max_cudagraph_capture_size,
            measure_moe_routing=self.measure_moe_routing,
            cache=CacheConfig(
                block_size=self.block_size,
                gpu_memory_utilization=self.gpu_memory_utilization,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                enable_prefix_caching=self.enable_prefix_caching,
            ),
            lora=LoRAConfig(
                max_loras=self.max_loras if self.enable_lora else 0,
                max_lora_rank=self.max_lora_rank,
                target_modules=self.lora_target_modules,
                max_cpu_loras=self.max_cpu_loras,
                max_cpu_lora_bytes=self.max_cpu_lora_bytes,
                registry=self.lora_registry,
                disk_cache_dir=self.lora_cache_dir,
                load_workers=self.lora_load_workers,
                load_timeout=self.lora_load_timeout,
            ),
            speculative=speculative,
            tensor_parallel_size=self.tensor_parallel_size,
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens or max(8192, self.max_num_seqs),
                max_model_len=self.max_model_len or model_cfg.max_position_embeddings,
            ),
        )

    def _check_tensor_parallel(self, model_cfg, device: str, speculative: SpeculativeConfig | None) -> None:
        size = self.tensor_parallel_size
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
        if size == 1:
            return
        shard_config(model_cfg, size)  # names what does not split
        if device.startswith("cuda") and size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={size} but {torch.cuda.device_count()} GPUs are visible")
        if device.startswith("cuda:"):
            raise ValueError("with tensor_parallel_size > 1 the ranks take GPUs 0..N-1: say device cuda "
                             "and choose the GPUs with CUDA_VISIBLE_DEVICES")
        if speculative is not None and speculative.method == "draft_model":
            raise ValueError("a draft model is not served with tensor parallelism (ngram speculation is)")

    def _quantization(self, checkpoint: QuantConfig | None) -> QuantConfig | None:
        """The checkpoint's quantization, or the one asked for: load-time fp8, or any
        method's format for random weights (its usual coverage: MXFP4 on experts, int4 on
        dense projections, fp8 on both)."""
        asked = self.quantization
        if asked is None or (checkpoint is not None and checkpoint.method == asked):
            return self._activations(checkpoint)
        if checkpoint is not None:
            raise ModelLoadError(f"the checkpoint is {checkpoint.method}-quantized; --quantization "
                                 f"{asked} cannot apply to it")
        if self.load_format != "dummy" and asked != "fp8":
            raise ModelLoadError(f"--quantization {asked} needs a checkpoint quantized so, or "
                                 "--load-format dummy (only fp8 quantizes a bf16 checkpoint as it loads)")
        return self._activations(QuantConfig.requested(asked, online=self.load_format != "dummy"))

    def _activations(self, quant: QuantConfig | None) -> QuantConfig | None:
        """quant with the FP8 activations asked for (--fp8-activations)."""
        if self.fp8_activations not in FP8_ACTIVATIONS:
            raise ValueError(f"fp8_activations must be one of {', '.join(FP8_ACTIVATIONS)}, "
                             f"got {self.fp8_activations!r}")
        if self.fp8_activations == "unquantized":
            return quant
        flag = f"--fp8-activations {self.fp8_activations}"
        if quant is None:
            raise ModelLoadError(f"{flag} applies to FP8 weights: this checkpoint is not quantized "
                                 "(--quantization fp8 quantizes it as it loads)")
        try:
            return quant.with_dynamic_activations(
                W8A8_PREFILL_MIN_TOKENS if self.fp8_activations == "prefill" else 0)
        except UnsupportedModel as e:
            raise ModelLoadError(f"{flag}: {e}") from e

    def create_engine(self) -> LLMEngine:
        """The engine, with the model's tokenizer (engine.tokenizer) and the stop strings
        its generation config declares."""
        config = self.create_engine_config()
        return LLMEngine(config, load_tokenizer(self.tokenizer or self.model),
                         max_logprobs=self.max_logprobs, async_scheduling=self.async_scheduling,
                         default_stop=_generation_config(self.model)["stop_strings"])


def _resolve_backend(name: str, device: str) -> str:
    if name == "auto":
        return "triton" if device.startswith("cuda") else "torch"
    if name not in ("torch", "triton"):
        raise ValueError(f"ops_backend must be 'auto', 'torch' or 'triton', got {name!r}")
    return name


def _resolve_dtype(dtype: str | torch.dtype, checkpoint: str, device: str) -> str:
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    if dtype == "auto":
        if device.startswith("cpu"):
            return "float32"
        dtype = checkpoint if checkpoint in DTYPES else "bfloat16"
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _generation_config(model_dir: str) -> dict:
    """End-of-sequence tokens and stop strings the model directory declares in
    generation_config.json (Llama 3 Instruct lists several EOS tokens; a base model
    served with a plain chat template can name its turn separator as a stop string)."""
    path = Path(model_dir) / "generation_config.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    eos = data.get("eos_token_id")
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    stops = []
    for key in ("stop_strings", STOP_STRINGS_KEY):  # transformers' own, and loraplex's
        value = data.get(key) or []
        stops += [value] if isinstance(value, str) else value
    return {"eos": eos, "stop_strings": tuple(stops)}
