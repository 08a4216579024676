"""OpenAI request bodies (plus vLLM's extensions) and their translation to SamplingParams.

Bodies are validated here: wrong types, out-of-range values, strings that are not valid
Unicode and fields this server does not implement become 400 errors with an OpenAI-style
body before anything reaches the engine. No field is silently ignored: an unknown field
is refused, fields of OpenAI's API that are not implemented are accepted only at their
neutral value, and only `user` and `metadata` pass unused (OpenAI's abuse-monitoring id
and the metadata of stored completions: neither changes what is generated). Tools are
server/tools.py's.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from loraplex.errors import InvalidRequest
from loraplex.server.tools import NamedToolChoice, Tool, ToolCall, ToolCallParser, ToolMode, tool_mode
from loraplex.types import SamplingParams, StructuredOutputs

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024  # text that may be a stop string's start is held back
MAX_STOP_TOKEN_IDS = 1024  # each step bans them while min_tokens holds
MAX_PROMPTS = 256  # per completions request
MAX_TOOLS = 128  # per chat request (OpenAI's limit)


def error_body(message: str, type_: str = "invalid_request_error", code: int = 400,
               param: str | None = None) -> dict:
    return {"error": {"message": printable(message), "type": type_,
                      "param": printable(param) if param is not None else None, "code": code}}


def printable(text: str) -> str:
    """`text` as valid UTF-8, lone surrogates (which no encoder takes) escaped."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def invalid_text_at(data: Any) -> str | None:
    """Where in a parsed JSON body a string is not valid Unicode (a lone surrogate, which
    JSON's \\ud800 escapes can carry), or None."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return where or "the body"
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((where, key))
                stack.append((f"{where}.{printable(str(key))}".lstrip("."), item))
        elif isinstance(value, list):
            stack.extend((f"{where}[{i}]", item) for i, item in enumerate(value))
    return None


class _Body(BaseModel):
    """A request body: unknown fields are errors (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = invalid_text_at(data)
        if where is not None:
            raise ValueError(f"{where} is not valid Unicode (it holds a lone surrogate)")
        return data


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class _SamplingFields(_Body):
    """Fields shared by completions and chat completions."""

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
    metadata: dict[str, str] | None = None
    # vLLM's extensions (its benchmark client sends some of them).
    top_k: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[str, float] | None = None  # token id (a string, as in OpenAI's API) -> bias
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs (json,
    # json_object, regex, choice, grammar) and its older guided_* fields: one at most.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # loraplex's: False keeps the request out of speculative decoding (--speculative-config).
    speculate: bool = True

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def unsupported(self) -> list[str]:
        """Fields set to something this server does not implement."""
        return []

    def structured(self) -> StructuredOutputs | None:
        """The one structured-output constraint the body asks for, if any."""
        fields = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                  "guided_grammar")
        asked = {name: getattr(self, name) for name in fields
                 if getattr(self, name) is not None and getattr(self, name) != {"type": "text"}}
        if not asked:
            return None
        if len(asked) > 1:
            raise InvalidRequest(f"one structured-output field at most, got {sorted(asked)}",
                                 param=min(asked))
        (name, value), = asked.items()
        if name == "response_format":
            kind = value.get("type")
            if kind == "json_object":
                return StructuredOutputs(json_object=True)
            schema = (value.get("json_schema") or {}).get("schema") if kind == "json_schema" else None
            if not isinstance(schema, dict):
                raise InvalidRequest("response_format is {\"type\": \"text\" | \"json_object\"} or "
                                     "{\"type\": \"json_schema\", \"json_schema\": {\"schema\": {...}}}",
                                     param="response_format")
            # strict or not, the schema is enforced in full (as vLLM does): nothing beyond it.
            return StructuredOutputs(json=schema)
        if name == "structured_outputs":
            known = {"json", "json_object", "regex", "choice", "grammar"}
            if not set(value) <= known:
                raise InvalidRequest(f"structured_outputs takes {sorted(known)}", param=name)
            return StructuredOutputs(**value)
        return StructuredOutputs(**{name.removeprefix("guided_"): value})

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Checks what SamplingParams does not: limits and unsupported features."""
        bad = self.unsupported()
        if bad:
            raise InvalidRequest(f"{bad[0]} is not supported by this server", param=bad[0])
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", param="stop")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
            raise InvalidRequest(f"stop strings are at most {MAX_STOP_STRING_CHARS} characters",
                                 param="stop")
        if len(self.stop_token_ids or ()) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids", param="stop_token_ids")
        bias = {}
        for token, value in (self.logit_bias or {}).items():
            if not token.lstrip("-").isdigit() or len(token) > 12:
                raise InvalidRequest(f"logit_bias keys are token ids, got {token!r}", param="logit_bias")
            bias[int(token)] = value
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
            best_of=getattr(self, "best_of", None),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=bias,
            min_p=self.min_p,
            structured_outputs=self.structured(),
            speculate=self.speculate,
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None  # candidates per prompt, the n most likely returned

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        if self.stream and (self.best_of or self.n) > self.n:
            raise InvalidRequest("best_of > n cannot stream (the best are known at the end)",
                                 param="best_of")
        return super().sampling_params(max_tokens, logprobs)

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if self.suffix:
            raise InvalidRequest("suffix is not supported by this server", param="suffix")
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequest("prompt is empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        if len(p) > MAX_PROMPTS:
            raise InvalidRequest(f"at most {MAX_PROMPTS} prompts per request, got {len(p)}",
                                 param="prompt")
        return list(p)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None  # handed to the chat template, which may use it
    tool_calls: list[ToolCall] | None = None  # an assistant's calls, sent back
    tool_call_id: str | None = None  # a tool message: the call it answers

    @model_validator(mode="after")
    def _fields_of_role(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("only tool messages carry tool_call_id")
        return self

    def template_dict(self) -> dict:
        text = self.content if not isinstance(self.content, list) else "".join(
            part.text for part in self.content)
        message = {"role": self.role, "content": text or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.template_dict() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None  # OpenAI's older tools: refused unless empty
    function_call: str | dict[str, Any] | None = None
    _tools: ToolMode | None = PrivateAttr(default=None)

    def unsupported(self) -> list[str]:
        return super().unsupported() + [name for name, ok in (
            ("functions", not self.functions), ("function_call", self.function_call in (None, "none")),
        ) if not ok]

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_mode(self, parser: ToolCallParser | None) -> ToolMode | None:
        """How this request uses its tools (checked; kept for sampling_params)."""
        self._tools = tool_mode(self.tools, self.tool_choice, self.parallel_tool_calls, parser)
        return self._tools

    def template_tools(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def structured(self) -> StructuredOutputs | None:
        asked = super().structured()
        forced = self._tools.structured() if self._tools is not None else None
        if asked is not None and forced is not None:
            raise InvalidRequest("tool_choice required or a named function constrains the output "
                                 "itself: no response_format or structured outputs beside it",
                                 param="tool_choice")
        return forced or asked


class LoadLoRAAdapterRequest(_Body):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    tenant: str | None = None  # loraplex: the owner; None = visible to every tenant


class UnloadLoRAAdapterRequest(_Body):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None
