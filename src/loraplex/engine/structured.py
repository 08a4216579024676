"""Structured outputs: a request's StructuredOutputs compiled into a token-level grammar
(xgrammar, a maintained grammar engine) off the engine thread, once per distinct
spec. The runner keeps a matcher per structured request, advances it with each token
the request samples and turns it into a bitmask of the tokens allowed next (runner/
structured.py); the request waits in the queue until its grammar is compiled, and a
spec that does not compile fails it alone.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from loraplex.errors import InvalidRequest
from loraplex.types import StructuredOutputs

MAX_CACHED = 256  # compiled grammars kept (by spec)
MAX_WHITESPACE = 24  # JSON: longest run of whitespace between tokens (indented output fits)


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]):
        import xgrammar

        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                        stop_token_ids=list(stop_token_ids))
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=2)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="loraplex-grammar")
        self._compiled: OrderedDict[str, Future] = OrderedDict()

    def submit(self, spec: StructuredOutputs) -> Future:
        """A future of the compiled grammar (or of an InvalidRequest saying why not)."""
        key = spec.key()
        future = self._compiled.get(key)
        if future is None or (future.done() and future.exception() is not None):
            future = self._compiled[key] = self._pool.submit(self._compile, spec)
            if len(self._compiled) > MAX_CACHED:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(key)
        return future

    def _compile(self, spec: StructuredOutputs):
        c = self._compiler
        try:
            if spec.json is not None or spec.json_object:
                schema = spec.json if spec.json is not None else {"type": "object"}  # any object
                # Whitespace runs are capped: a model may otherwise loop on blank space.
                return c.compile_json_schema(schema if isinstance(schema, str) else json.dumps(schema),
                                             strict_mode=spec.strict and not spec.json_object,
                                             any_whitespace=not spec.disable_any_whitespace,
                                             max_whitespace_cnt=MAX_WHITESPACE)
            if spec.regex is not None:
                return c.compile_regex(spec.regex)
            if spec.choice is not None:
                return c.compile_regex("|".join(f"({_escape(choice)})" for choice in spec.choice))
            return c.compile_grammar(spec.grammar)
        except Exception as e:  # the engine's message (schema, regex or grammar error)
            raise InvalidRequest(f"structured output spec does not compile: {e}") from None


def _escape(text: str) -> str:
    """`text` as a literal in xgrammar's (ECMAScript-like) regexes."""
    return re.sub(r"([.^$*+?()\[\]{}|\\/-])", r"\\\1", text)
