"""Tool calling: OpenAI's tools and tool_choice (none, a named function, required, auto)
over HTTP with OpenAI's client, streaming and not, and the call formats parsed for
"auto" (Hermes `<tool_call>`, Llama 3.1 JSON)."""

from __future__ import annotations

import json
import shutil

import jsonschema
import openai
import pytest
from serving import client, running, serve_args
from test_structured_outputs import byte_model  # noqa: F401  (the fixture)

from loraplex.server.tools import (
    PARSERS,
    Tool,
    ToolChoiceOutput,
    ToolMode,
    parser_for_template,
)

# A Hermes-style template (Qwen's format): tools in <tools>, calls in <tool_call>.
HERMES_TEMPLATE = (
    "{%- if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>\n"
    "{%- elif m.tool_calls %}{% for c in m.tool_calls %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}\n"
    "{%- else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}assistant:"
)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,10}$"},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "maximum": 99},
                                         "b": {"type": "integer", "maximum": 99}},
        "required": ["a", "b"]}}},
]
USER = [{"role": "user", "content": "weather in paris?"}]
FORCED_CALL = r'Let me check\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,6}", "days": [1-7]\}\}</tool_call>'  # noqa: E501


@pytest.fixture(scope="module")
def tool_model(byte_model, tmp_path_factory):  # noqa: F811
    from transformers import PreTrainedTokenizerFast

    dst = tmp_path_factory.mktemp("tools") / "qwen3"
    shutil.copytree(byte_model, dst)
    tok = PreTrainedTokenizerFast.from_pretrained(dst)
    tok.chat_template = HERMES_TEMPLATE
    tok.save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def server(tool_model):
    yield from running(serve_args(tool_model, "--max-model-len", "1024", "--served-model-name", "tiny"))


def chat(server, **kwargs):
    kwargs = {"messages": USER, "max_tokens": 120, "seed": 0, **kwargs}
    return client(server).chat.completions.create(model="tiny", **kwargs)


def test_a_named_function_is_called_with_arguments_its_schema_accepts(server):
    r = chat(server, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    ch = r.choices[0]
    assert ch.finish_reason == "stop" and ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    streamed = chat(server, tools=TOOLS, stream=True,
                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
    deltas = [d for chunk in streamed for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments  # same seed


def test_required_calls_one_or_more_of_the_tools(server):
    for parallel in (True, False):
        r = chat(server, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel, max_tokens=200)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch
        assert 1 <= len(ch.message.tool_calls) <= (99 if parallel else 1)
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        for call in ch.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    streamed = chat(server, tools=TOOLS, tool_choice="required", stream=True, max_tokens=200)
    calls = [d for chunk in streamed if chunk.choices for d in (chunk.choices[0].delta.tool_calls or [])]
    assert calls and all(d.function.name in ("get_weather", "add") for d in calls)


def test_auto_parses_the_templates_format_streaming_and_not(server):
    """A regex forces the model to write a Hermes call after some text: "auto" returns
    the text as content and the call as tool_calls."""
    force = {"structured_outputs": {"regex": FORCED_CALL}}
    r = chat(server, tools=TOOLS, extra_body=force)  # tool_choice defaults to auto
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Let me check."
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    content, calls, reasons = "", [], []
    for chunk in chat(server, tools=TOOLS, tool_choice="auto", extra_body=force, stream=True):
        if chunk.choices:
            content += chunk.choices[0].delta.content or ""
            calls += chunk.choices[0].delta.tool_calls or []
            reasons.append(chunk.choices[0].finish_reason)
    assert content.strip() == "Let me check." and "<tool_call>" not in content
    assert [c.function.name for c in calls] == ["get_weather"] and reasons[-1] == "tool_calls"
    assert json.loads(calls[0].function.arguments) == json.loads(call.function.arguments)


def test_a_tool_call_round_trip(server):
    """The client runs the call and sends the assistant's call and the tool's result
    back; the template renders both (and the tools) into the next prompt."""
    first = chat(server, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})
    call = first.choices[0].message.tool_calls[0]
    args = json.loads(call.function.arguments)
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])},
    ]
    answer = chat(server, tools=TOOLS, tool_choice="none", messages=history, max_tokens=8)
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].message.content is not None
    plain = chat(server, messages=USER, max_tokens=1)
    with_tools = chat(server, tools=TOOLS, tool_choice="none", messages=USER, max_tokens=1)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens, "the tools reach the template"
    assert answer.usage.prompt_tokens > with_tools.usage.prompt_tokens + 10, "the call and result too"


@pytest.mark.parametrize("kwargs, param", [
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS + TOOLS[:1], tool_choice="required"), "tools"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), None),
    (dict(messages=[{"role": "user", "content": "x", "tool_calls": []}]), None),
    (dict(messages=[{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{not json"}}]}]),
     "messages"),
])
def test_bad_tool_requests_are_400s(server, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, **kwargs)
    if param is not None:
        assert e.value.body["param"] == param, e.value.body


def test_auto_needs_a_known_format_and_tools_are_for_chat(byte_model):  # noqa: F811
    """The plain template teaches no call format: auto (also the default with tools) is a
    400 saying so, while named and required calls still work; completions take no tools."""
    import httpx

    served = running(serve_args(byte_model, "--max-model-len", "1024", "--served-model-name", "tiny"))
    s = next(served)
    try:
        for choice in ("auto", None):
            extra = {} if choice is None else {"tool_choice": choice}
            with pytest.raises(openai.BadRequestError, match="tool-call-parser") as e:
                chat(s, tools=TOOLS, **extra)
            assert e.value.body["param"] == "tool_choice"
        r = chat(s, tools=TOOLS, tool_choice="required", max_tokens=200)
        assert r.choices[0].message.tool_calls
        body = {"model": "tiny", "prompt": "x", "max_tokens": 2, "tools": TOOLS}
        bad = httpx.post(s.url + "/v1/completions", json=body, headers={"Authorization": "Bearer x"})
        assert bad.status_code == 400 and "tools" in bad.json()["error"]["message"]
    finally:
        next(served, None)


def test_parsers_read_hermes_and_llama3_json():
    hermes, llama = PARSERS["hermes"], PARSERS["llama3_json"]
    text = ('ok <tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>'
            '<tool_call>{"name": "b", "arguments": {}}')
    assert hermes.calls_at(text) == 3 and hermes.parse(text[3:]) == [("a", {"x": 1}), ("b", {})]
    assert hermes.parse("<tool_call>{broken</tool_call>") is None
    text = '<|python_tag|>{"name": "a", "parameters": {"x": "};{"}}; {"name": "b", "parameters": {"y": 2}}'
    assert llama.calls_at(text) == 0
    assert llama.parse(text) == [("a", {"x": "};{"}), ("b", {"y": 2})]
    assert llama.parse('{"name": "a", "parameters": {}} trailing words') is None
    assert llama.parse('{"name": "a", "parameters": {"x": 1}}') == [("a", {"x": 1})]
    assert llama.calls_at("The answer is 4.") is None
    assert parser_for_template(HERMES_TEMPLATE) is hermes
    assert parser_for_template("{{ '<|python_tag|>' }}{% for t in tools %}{% endfor %}") is llama
    assert parser_for_template("{{ messages }}") is None


@pytest.mark.parametrize("text", [
    'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "oslo", "days": 2}}</tool_call>',
    "no call here, just <tool_ words",
    '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>',
])
def test_streamed_auto_deltas_add_up_to_the_whole_message(text):
    mode = ToolMode("auto", [Tool.model_validate(t) for t in TOOLS], parser=PARSERS["hermes"])
    content, calls = ToolChoiceOutput(mode).message(text)
    out, streamed, streamed_calls = ToolChoiceOutput(mode), "", []
    for end in range(1, len(text) + 1, 3):
        c, d = out.delta(text[:end], False)
        streamed += c or ""
        streamed_calls += d
    c, d = out.delta(text, True)
    streamed += c or ""
    streamed_calls += d
    assert streamed.strip() == (content or "").strip()
    assert [(x["function"]["name"], x["function"]["arguments"]) for x in streamed_calls] == \
        [(x["function"]["name"], x["function"]["arguments"]) for x in calls]
    assert "<tool_call>" not in streamed or not calls
