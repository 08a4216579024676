"""The offline API, shaped like vLLM's `LLM` so its users switch by changing an import."""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast

from loraplex.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
from loraplex.engine.engine import LLMEngine
from loraplex.errors import InvalidRequest, ModelLoadError
from loraplex.models.default_model import STOP_STRINGS_KEY
from loraplex.types import LoRARequest, RequestOutput, SamplingParams

_DTYPES = {
    "float32": "float32", "float": "float32", "fp32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "half": "float16", "fp16": "float16",
}

PromptType = str | list[int] | dict


class LLM:
    """Generate from a base model and many LoRA adapters in one batch.

    Arguments mirror vLLM's engine arguments. dtype="auto" takes the checkpoint's dtype
    on GPU and float32 on CPU (where bf16 matmuls are slow). max_model_len defaults to
    the model's max_position_embeddings. ops_backend="auto" runs Triton kernels on GPU
    and the plain-torch reference ops on CPU; enforce_eager=True skips CUDA graphs
    (cudagraph_mode="FULL_DECODE_ONLY" keeps them for decode steps only; mixed steps of
    up to max_cudagraph_capture_size tokens replay them by default).
    async_scheduling plans and launches each step before reading the previous one's
    tokens (as vLLM's --async-scheduling), hiding host work behind the device's.
    """

    def __init__(
        self,
        model: str,
        *,
        tokenizer: str | None = None,
        dtype: str | torch.dtype = "auto",
        device: str | None = None,
        seed: int = 0,
        load_format: str = "auto",
        enable_lora: bool = True,
        max_loras: int = 8,
        max_lora_rank: int = 64,
        max_cpu_loras: int | None = None,
        max_cpu_lora_bytes: int | None = None,
        lora_registry: str | None = None,
        lora_cache_dir: str | None = None,
        lora_load_workers: int = 4,
        lora_load_timeout: float = 120.0,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        block_size: int = 16,
        gpu_memory_utilization: float = 0.9,
        num_gpu_blocks_override: int | None = None,
        max_logprobs: int = 20,
        ops_backend: str = "auto",
        enforce_eager: bool = False,
        cudagraph_mode: str = "FULL",
        max_cudagraph_capture_size: int = 2048,
        async_scheduling: bool = True,
        measure_moe_routing: bool = False,
    ):
        if load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format must be 'auto', 'safetensors' or 'dummy', got {load_format!r}")
        if not (Path(model) / "config.json").is_file():  # else transformers takes it for a Hub id
            raise ModelLoadError(f"{model}: not a model directory (no config.json)")
        hf_config = AutoConfig.from_pretrained(model)
        model_cfg = ModelConfig.from_hf(hf_config)
        generation = _generation_config(model)
        model_cfg = replace(model_cfg, eos_token_ids=tuple(sorted(
            {*model_cfg.eos_token_ids, *generation["eos"]})))
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        max_model_len = max_model_len or model_cfg.max_position_embeddings
        max_num_batched_tokens = max_num_batched_tokens or max(8192, max_num_seqs)
        self.config = EngineConfig(
            model_path=str(model),
            model=model_cfg,
            dtype=_resolve_dtype(dtype, model_cfg.dtype, device),
            device=device,
            seed=seed,
            load_format="dummy" if load_format == "dummy" else "auto",
            ops_backend=_resolve_backend(ops_backend, device),
            cudagraph_mode="NONE" if enforce_eager else cudagraph_mode,
            max_cudagraph_capture_size=max_cudagraph_capture_size,
            measure_moe_routing=measure_moe_routing,
            cache=CacheConfig(
                block_size=block_size,
                gpu_memory_utilization=gpu_memory_utilization,
                num_gpu_blocks_override=num_gpu_blocks_override,
            ),
            lora=LoRAConfig(
                max_loras=max_loras if enable_lora else 0,
                max_lora_rank=max_lora_rank,
                max_cpu_loras=max_cpu_loras,
                max_cpu_lora_bytes=max_cpu_lora_bytes,
                registry=lora_registry,
                disk_cache_dir=lora_cache_dir,
                load_workers=lora_load_workers,
                load_timeout=lora_load_timeout,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
            ),
        )
        self.tokenizer = load_tokenizer(tokenizer or model)
        self.engine = LLMEngine(self.config, self.tokenizer, max_logprobs=max_logprobs,
                                async_scheduling=async_scheduling,
                                default_stop=generation["stop_strings"])
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the prompts' order.

        A prompt is a string, a list of token ids, or {"prompt_token_ids": [...]}.
        sampling_params and lora_request are one for all prompts or a list parallel to
        them; a None lora_request means the base model. Invalid prompts and bad adapters
        raise before any prompt is queued (when the batch has more distinct adapters
        than host memory holds, an adapter that fails to load later raises its error
        once the other requests are aborted).
        """
        prompts = _as_prompt_list(prompts)
        n = len(prompts)
        params = _broadcast(sampling_params or SamplingParams(), n, "sampling_params")
        loras = _broadcast(lora_request, n, "lora_request")

        # Adapters that fit host memory together are loaded first (errors raise before
        # anything is queued, and the schedule does not depend on load timing); more
        # than that stream through host memory as requests reach them.
        distinct = {lora.key: lora for lora in loras if lora is not None}
        manager = self.engine.adapters
        if manager is not None and 0 < len(distinct) <= manager.host.capacity:
            for lora in distinct.values():
                self.engine.load_adapter(lora)

        queued = []
        try:
            for prompt, sp, lora in zip(prompts, params, loras):
                text, ids = self._tokenize(prompt)
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, ids, sp, lora, prompt=text)
                queued.append(request_id)
        except Exception:
            for request_id in queued:
                self.engine.abort_request(request_id)
            raise

        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=n, desc="Generating", unit="req", disable=not use_tqdm, leave=False)
        while len(finished) < n:
            for out in self.engine.step():
                if out.error is not None:
                    for request_id in queued:
                        self.engine.abort_request(request_id)
                    while self.engine.has_unfinished_requests():
                        self.engine.step()  # the step in flight
                    bar.close()
                    raise out.error
                if out.finished:
                    finished[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [finished[request_id] for request_id in queued]

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            raise InvalidRequest("a dict prompt needs 'prompt_token_ids' or 'prompt'")
        return None, list(prompt)


def load_tokenizer(path: str):
    """The tokenizer a model directory declares.

    transformers 5 may override a declared generic tokenizer.json with the model type's
    own tokenizer class; a directory that says tokenizer_class TokenizersBackend or
    PreTrainedTokenizerFast gets exactly that.
    """
    config_file = Path(path) / "tokenizer_config.json"
    declared = json.loads(config_file.read_text()).get("tokenizer_class") if config_file.is_file() else None
    if declared in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def _as_prompt_list(prompts) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _broadcast(value, n: int, name: str) -> list:
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != n:
            raise InvalidRequest(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n


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
        dtype = checkpoint if checkpoint in _DTYPES else "bfloat16"
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


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
