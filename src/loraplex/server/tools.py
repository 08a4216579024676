"""Tool calling for chat completions: OpenAI's `tools` and `tool_choice`.

- "none": plain text (the tools still reach the chat template, as in vLLM);
- a named function: the output is constrained to that function's parameters schema and
  returned as its call's arguments;
- "required": the output is constrained to a JSON list of one or more
  {"name", "parameters"} calls of the given tools (vLLM's format);
- "auto" (OpenAI's default when tools are given): the model writes calls in its chat
  template's own format, parsed out of the text by a ToolCallParser: "hermes"
  (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, Qwen and others) or
  "llama3_json" (`{"name": ..., "parameters": ...}` calls separated by `;`, Llama 3.1+),
  chosen by `--tool-call-parser` or recognised from the template.

Streaming: a named call's arguments stream as they are generated; required and auto
calls are sent whole once the text that holds them is complete (auto's text before its
first call streams as content).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from loraplex.errors import InvalidRequest
from loraplex.types import StructuredOutputs

NAME_PATTERN = r"^[A-Za-z0-9_.:-]{1,64}$"


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # enforced in full either way (the grammar)


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str  # JSON text, as OpenAI sends it back


class ToolCall(BaseModel):
    """A call in an assistant message the client sends back."""

    model_config = ConfigDict(extra="forbid")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def template_dict(self) -> dict:
        """Chat templates read arguments as a mapping (Llama's `| tojson`, Qwen's loop)."""
        try:
            arguments = json.loads(self.function.arguments)
        except json.JSONDecodeError:
            raise InvalidRequest(f"tool call {self.function.name!r}: arguments are not JSON",
                                 param="messages") from None
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": arguments}}


def params_schema(fn: FunctionDef) -> dict:
    return fn.parameters if fn.parameters is not None else {"type": "object", "properties": {}}


# -- parsing calls out of text ("auto") ---------------------------------------------------

class ToolCallParser:
    """Finds the calls a model wrote in its own format. `start`: text that begins the
    calls, or None where the calls are the whole output."""

    name: str
    start: str | None

    def calls_at(self, text: str) -> int | None:
        """Where the calls begin in `text` (so far), or None."""
        raise NotImplementedError

    def parse(self, text: str) -> list[tuple[str, Any]] | None:
        """(name, arguments) of each call in `text` from calls_at on, or None if they
        do not parse (the text is then returned as content)."""
        raise NotImplementedError


class HermesParser(ToolCallParser):
    name, start = "hermes", "<tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def calls_at(self, text):
        i = text.find(self.start)
        return None if i < 0 else i

    def parse(self, text):
        calls = []
        for m in self._CALL.finditer(text):
            try:
                calls.append(_call_of(json.loads(m.group(1)), "arguments"))
            except (json.JSONDecodeError, ValueError):
                return None
        return calls or None


class Llama3JsonParser(ToolCallParser):
    name, start = "llama3_json", None
    _TAG = "<|python_tag|>"

    def calls_at(self, text):
        stripped = text.lstrip()
        if stripped.startswith(self._TAG) or stripped.startswith("{"):
            return len(text) - len(stripped)
        return None

    def parse(self, text):
        body, calls, decoder = text.strip().removeprefix(self._TAG).strip(), [], json.JSONDecoder()
        at = 0
        while at < len(body):  # objects separated by ";"
            try:
                call, at = decoder.raw_decode(body, at)
                calls.append(_call_of(call, "parameters"))
            except (json.JSONDecodeError, ValueError):
                return None
            at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
        return calls or None


def _call_of(call, key: str) -> tuple[str, Any]:
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ValueError("not a call")
    return call["name"], call.get(key, call.get("arguments", call.get("parameters", {})))


PARSERS = {p.name: p for p in (HermesParser(), Llama3JsonParser())}


def parser_for_template(template: str | None) -> ToolCallParser | None:
    """The format a chat template teaches its model, recognised by its markers."""
    if not template:
        return None
    if "<tool_call>" in template:
        return PARSERS["hermes"]
    if "<|python_tag|>" in template or ('"parameters"' in template and "tools" in template):
        return PARSERS["llama3_json"]
    return None


# -- one request's tool mode ----------------------------------------------------------------

@dataclass
class ToolMode:
    """How one chat request uses its tools."""

    kind: Literal["named", "required", "auto"]
    tools: list[Tool]
    parser: ToolCallParser | None = None
    name: str | None = None  # named: the function
    parallel: bool = True

    def structured(self) -> StructuredOutputs | None:
        if self.kind == "named":
            fn = next(t.function for t in self.tools if t.function.name == self.name)
            return StructuredOutputs(json=params_schema(fn))
        if self.kind == "required":
            one_of = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                       "parameters": params_schema(t.function)},
                       "required": ["name", "parameters"]} for t in self.tools]
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutputs(json=schema)
        return None


def tool_mode(tools: list[Tool] | None, choice, parallel: bool | None,
              parser: ToolCallParser | None) -> ToolMode | None:
    """The request's ToolMode, or None when it generates plain text."""
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise InvalidRequest(f"tool_choice is none, auto, required or a named function, got {choice!r}",
                             param="tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequest("tool_choice needs tools", param="tool_choice")
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequest("tool names must be distinct", param="tools")
    parallel = parallel is not False
    if choice == "none":
        return None
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise InvalidRequest(f"tool_choice names {choice.function.name!r}, which is not in tools",
                                 param="tool_choice")
        return ToolMode("named", tools, name=choice.function.name, parallel=parallel)
    if choice == "required":
        return ToolMode("required", tools, parallel=parallel)
    if parser is None:  # "auto", given or by default
        raise InvalidRequest("tool_choice auto needs a tool-call format: this model's chat template "
                             "has none loraplex recognises; start the server with --tool-call-parser "
                             "(hermes, llama3_json), or use tool_choice required or a named function",
                             param="tool_choice")
    return ToolMode("auto", tools, parser=parser, parallel=parallel)


def _call(name: str, arguments: Any) -> dict:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": text}}


@dataclass
class ToolChoiceOutput:
    """Turns one choice's generated text into content and tool calls, whole or as
    stream deltas."""

    mode: ToolMode
    text: str = ""  # the choice's text so far (streamed choices gather it here)
    sent: int = 0  # characters of the text consumed by deltas
    call_id: str | None = None  # named: the call its argument deltas belong to
    calls: list[dict] = field(default_factory=list)

    def message(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of the finished text."""
        mode = self.mode
        if mode.kind == "named":
            return None, [_call(mode.name, text)]
        if mode.kind == "required":
            try:
                return None, [_call(c["name"], c["parameters"]) for c in json.loads(text)]
            except (json.JSONDecodeError, TypeError, KeyError):
                return text, []  # cut off by max_tokens
        at = mode.parser.calls_at(text)
        parsed = mode.parser.parse(text[at:]) if at is not None else None
        if not parsed:
            return text, []
        if not mode.parallel:
            parsed = parsed[:1]
        content = text[:at].strip() or None
        return content, [_call(name, arguments) for name, arguments in parsed]

    def delta(self, text: str, finished: bool) -> tuple[str | None, list[dict]]:
        """(content delta, tool_call deltas) for the text so far: `text` is the choice's
        whole text, of which `sent` characters were consumed."""
        mode = self.mode
        if mode.kind == "named":
            new, self.sent = text[self.sent:], len(text)
            if self.call_id is None:
                self.call_id = _call(mode.name, "")["id"]
                return None, [{"index": 0, "id": self.call_id, "type": "function",
                               "function": {"name": mode.name, "arguments": new}}]
            return None, [{"index": 0, "function": {"arguments": new}}] if new else []
        at = mode.parser.calls_at(text) if mode.kind == "auto" else None
        if not finished:
            if mode.kind == "required":
                return None, []
            if at is None:  # hold back what may be the start of a call
                start = mode.parser.start
                at = len(text) - (len(start) - 1 if start else len(text) - len(text.lstrip()))
            new, self.sent = text[self.sent:max(at, self.sent)], max(at, self.sent)
            return new or None, []
        _, calls = self.message(text)
        if mode.kind == "required":
            new = None if calls else text  # cut off before its list closed: the text as content
        else:  # auto: the content not sent yet, up to the calls
            new = text[self.sent:max(at, self.sent)] if calls else text[self.sent:]
        self.sent = len(text)
        return new or None, [{"index": i, **call} for i, call in enumerate(calls)]
