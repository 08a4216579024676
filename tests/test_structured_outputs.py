"""Structured outputs: JSON schemas, json_object, regexes, choices and grammars constrain
sampling (xgrammar masks), offline and over HTTP with OpenAI's client, beside requests
that are not constrained and are not changed by them. The tiny model here has a byte-level
tokenizer, so it can spell any text."""

from __future__ import annotations

import json
import re
import shutil

import jsonschema
import openai
import pytest
from conftest import VOCAB, make_llm
from serving import CHAT_TEMPLATE, client, running, serve_args

from loraplex import InvalidRequest, SamplingParams, StructuredOutputs
from loraplex.bench.synthetic import write_byte_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        # (xgrammar 0.2.8 lets maxLength strings hold raw control characters, which JSON
        # forbids: a pattern bounds this one.)
        "name": {"type": "string", "pattern": "^[A-Za-z ]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "ok", "tags"],
}


@pytest.fixture(scope="module")
def byte_model(model_dirs, tmp_path_factory):
    """The tiny Qwen3 with a byte-level BPE tokenizer (ids 1, 2: bos, eos) and a chat template."""
    from transformers import PreTrainedTokenizerFast

    dst = tmp_path_factory.mktemp("bytes") / "qwen3"
    shutil.copytree(model_dirs["qwen3"], dst)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (dst / name).unlink(missing_ok=True)
    write_byte_tokenizer(dst, VOCAB)
    tok = PreTrainedTokenizerFast.from_pretrained(dst)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def llm(byte_model):
    return make_llm(byte_model, max_num_seqs=32, max_model_len=512)


def text_prompts(n: int) -> list[str]:
    """Prompts that are text: random ids could end inside a UTF-8 character."""
    return [f"request {i}: describe someone" for i in range(n)]


def constrained(max_tokens=200, seed=None, **spec) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed,
                          structured_outputs=StructuredOutputs(**spec))


def test_json_schema_holds_for_every_request_in_a_mixed_batch(llm):
    """200 sampled requests with a schema, in batches beside unconstrained ones: every one
    ends on its own (not at max_tokens) with JSON its schema accepts, and the
    unconstrained requests get exactly the tokens they get alone."""
    prompts = text_prompts(200)
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(prompts[:20], plain, use_tqdm=False)
    batch = []  # every tenth row unconstrained, so masked and unmasked rows interleave
    for i in range(200):
        batch.append((prompts[i], constrained(seed=i, json=SCHEMA, disable_any_whitespace=i % 2 == 0)))
        if i % 10 == 9:
            batch.append((prompts[i // 10], plain))
    outs = llm.generate([p for p, _ in batch], [sp for _, sp in batch], use_tqdm=False)
    structured = [o for o, (_, sp) in zip(outs, batch) if sp is not plain]
    for out in structured:
        o = out.outputs[0]
        assert o.finish_reason == "stop", (o.text, o.finish_reason)
        jsonschema.validate(json.loads(o.text), SCHEMA)
    for out in structured[::2]:  # disable_any_whitespace: one layout, json.dumps's
        assert json.dumps(json.loads(out.outputs[0].text)) == out.outputs[0].text
    for a, b in zip(alone, [o for o, (_, sp) in zip(outs, batch) if sp is plain], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.parametrize("spec, check", [
    (dict(regex=r"[a-z]{2,5}-\d{3}"), lambda t: re.fullmatch(r"[a-z]{2,5}-\d{3}", t)),
    (dict(choice=["red", "green", "blue (dark)"]), lambda t: t in ("red", "green", "blue (dark)")),
    (dict(grammar='root ::= "yes" | "no" | "n=" [0-9] [0-9]?'), lambda t: re.fullmatch(r"yes|no|n=\d\d?", t)),
    (dict(json_object=True), lambda t: isinstance(json.loads(t), dict)),
])
def test_regex_choice_grammar_and_json_object(llm, spec, check):
    outs = llm.generate(text_prompts(12), [constrained(seed=i, **spec) for i in range(12)],
                        use_tqdm=False)
    for out in outs:
        if "json_object" in spec and out.outputs[0].finish_reason == "length":
            continue  # any object may be longer than max_tokens; the rest must be whole
        assert out.outputs[0].finish_reason == "stop" and check(out.outputs[0].text), out.outputs[0].text


def test_overlapped_steps_feed_the_grammar_the_token_in_flight(byte_model, llm):
    """With async scheduling the token sampled by the step in flight reaches the matcher
    from the device: the same seeded outputs as stepping one step at a time."""
    prompts = text_prompts(6)
    params = [constrained(seed=i, json=SCHEMA) for i in range(6)]
    serial = make_llm(byte_model, max_model_len=512, async_scheduling=False)
    for a, b in zip(serial.generate(prompts, params, use_tqdm=False), llm.generate(prompts, params,
                                                                                  use_tqdm=False)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.parametrize("spec", [
    dict(), dict(regex="a", choice=["a"]), dict(json=5), dict(regex=["a"]), dict(choice=[]),
    dict(choice=["a", ""]), dict(grammar="x" * 70000),
])
def test_malformed_specs_are_refused(spec):
    with pytest.raises(InvalidRequest):
        SamplingParams(structured_outputs=StructuredOutputs(**spec))


def test_grammar_decides_the_end():
    for extra in (dict(ignore_eos=True), dict(min_tokens=3)):
        with pytest.raises(InvalidRequest, match="grammar"):
            SamplingParams(structured_outputs=StructuredOutputs(regex="a+"), **extra)


def test_a_spec_that_does_not_compile_fails_its_request_alone(llm):
    with pytest.raises(InvalidRequest, match="does not compile"):
        llm.generate([[5, 6]], constrained(regex="(unclosed"), use_tqdm=False)
    with pytest.raises(InvalidRequest, match="does not compile"):
        llm.generate([[5, 6]], constrained(json='{"type": "object", "properties": 7}'), use_tqdm=False)
    out = llm.generate([[5, 6]], constrained(seed=0, choice=["fine"]), use_tqdm=False)[0]
    assert out.outputs[0].text == "fine"


def test_a_vocabulary_that_cannot_spell_the_grammar_ends_the_request(model_dirs):
    """The word-level tiny model has no token that starts JSON: the request stops at
    once (only EOS is allowed), and requests beside it run as they do alone."""
    words = make_llm(model_dirs["qwen3"], max_model_len=128)
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = words.generate([[5, 6, 7]], plain, use_tqdm=False)[0]
    outs = words.generate([[5, 6], [5, 6, 7]], [constrained(json_object=True), plain], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "stop" and outs[0].outputs[0].token_ids == [2]
    assert outs[1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_compiled_grammars_are_cached_by_spec(llm):
    engine = llm.engine
    a = engine.compile_grammar(StructuredOutputs(regex="[0-9]+"))
    assert engine.compile_grammar(StructuredOutputs(regex="[0-9]+")) is a
    assert engine.compile_grammar(StructuredOutputs(regex="[0-9]*")) is not a


@pytest.fixture(scope="module")
def server(byte_model):
    yield from running(serve_args(byte_model, "--max-model-len", "400", "--served-model-name", "tiny"))


def test_openai_client_response_format_and_vllm_fields(server):
    c = client(server)
    chat = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "who?"}], max_tokens=150, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
    obj = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                    max_tokens=300, seed=2, response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    regex = c.completions.create(model="tiny", prompt="code:", max_tokens=20, seed=3,
                                 extra_body={"structured_outputs": {"regex": r"[A-Z]{3}\d"}})
    assert re.fullmatch(r"[A-Z]{3}\d", regex.choices[0].text)
    choice = c.completions.create(model="tiny", prompt="pick", max_tokens=20, seed=4, n=3,
                                  extra_body={"guided_choice": ["left", "right"]})
    assert {ch.text for ch in choice.choices} <= {"left", "right"}
    streamed = c.completions.create(model="tiny", prompt="s", max_tokens=20, seed=5, stream=True,
                                    extra_body={"guided_regex": "(ab){2,3}"})
    assert re.fullmatch("(ab){2,3}", "".join(ch.choices[0].text for ch in streamed if ch.choices))


@pytest.mark.parametrize("body, param", [
    ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, None),
    ({"extra_body": {"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}}, "guided_choice"),
    ({"extra_body": {"structured_outputs": {"pattern": "a"}}}, "structured_outputs"),
    ({"extra_body": {"response_format": {"type": "json_schema"}}}, "response_format"),
    ({"extra_body": {"guided_json": '{"type": "object", "properties": 7}'}}, None),
])
def test_bad_specs_are_400s_before_anything_streams(server, body, param):
    c = client(server)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="tiny", prompt="x", max_tokens=5, stream=stream, **body)
        assert e.value.body["type"] == "invalid_request_error"
        if param is not None:
            assert e.value.body["param"] == param
    ok = c.completions.create(model="tiny", prompt="x", max_tokens=20, seed=0,
                              extra_body={"guided_choice": ["still here"]})
    assert ok.choices[0].text == "still here"


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "city": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"}},
    "required": ["name", "age", "city"],
}


def test_gemma_json_adapter_answers_200_chats_with_valid_json():
    """The real Gemma 3 270M (the default model, built once from its PyPI package) with
    the `json` demo adapter, over HTTP with OpenAI's client: 200 concurrent chats with a
    json_schema response_format all parse and validate."""
    from concurrent.futures import ThreadPoolExecutor

    from loraplex.entrypoints.default_model import default_model_dir, demo_adapters

    argv = serve_args(default_model_dir(), "--max-model-len", "256", "--max-lora-rank", "8",
                      "--lora-modules", f"json={dict(demo_adapters())['json']}")
    server = running(argv)
    c = client(next(server))
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    def ask(i):
        r = c.chat.completions.create(
            model="json", max_tokens=80, temperature=0.8, seed=i, response_format=fmt,
            messages=[{"role": "user", "content": f"Describe person {i} as JSON."}])
        return r.choices[0]

    try:
        with ThreadPoolExecutor(32) as pool:
            choices = list(pool.map(ask, range(200)))
    finally:
        next(server, None)
    for choice in choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert len({ch.message.content for ch in choices}) > 20, "seeded samples differ"

