"""OpenAI request bodies (plus vLLM's extensions) and their translation to SamplingParams.

Bodies are validated here: wrong types and out-of-range values become 400 errors with
an OpenAI-style body before anything reaches the engine.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from loraplex.errors import InvalidRequest
from loraplex.types import SamplingParams

MAX_STOP_STRINGS = 16
MAX_N = 1  # choices per request


def error_body(message: str, type_: str = "invalid_request_error", code: int = 400,
               param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float | None = Field(default=None)
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # vLLM's extensions (its benchmark client sends some of them).
    top_k: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    repetition_penalty: float = 1.0

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Checks what SamplingParams does not: limits and unsupported features."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        if self.n > MAX_N or self.n < 1:
            raise InvalidRequest(f"n must be between 1 and {MAX_N}, got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise InvalidRequest(f"{name} is not supported (must be 0)")
        if self.repetition_penalty != 1.0:
            raise InvalidRequest("repetition_penalty is not supported (must be 1)")
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            n=self.n,
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequest("prompt is empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise InvalidRequest(f"content part of type {part.get('type')!r} is not supported")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    tenant: str | None = None  # loraplex: the owner; None = visible to every tenant


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None
