"""Incremental detokenization and stop strings.

Decoding one token at a time is wrong for most tokenizers: a token's text depends on its
neighbours (SentencePiece drops a leading space at the start of a string, byte-level BPE
splits one character over several tokens). So each new token is decoded together with a
few tokens before it, and only the text past what those tokens already produced is
emitted; text ending in an incomplete character (U+FFFD) is held back until the next
token completes it.

Tokenizers backed by Hugging Face `tokenizers` do this in Rust (`DecodeStream`, primed
with the prompt's last tokens), a few microseconds a token; others use the same
algorithm in Python.
"""

from __future__ import annotations

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # older tokenizers
    DecodeStream = None

_CONTEXT_TOKENS = 5  # prompt tokens decoded as context for the first output token
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 use_rust: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # _ids[:_read] is context whose text was already emitted (or is prompt).
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._read = len(self._ids)
        self.num_tokens = 0  # output tokens consumed so far
        self._backend = getattr(tokenizer, "backend_tokenizer", None) if use_rust else None
        self._stream = None
        if self._backend is not None and DecodeStream is not None:
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            if self._ids:
                self._stream.step(self._backend, self._ids)  # context only: text dropped

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty)."""
        self.num_tokens += 1
        if self._stream is not None:
            return self._stream.step(self._backend, token_id) or ""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[: self._read])
        text = self._decode(self._ids)
        if len(text) <= len(prefix_text) or text.endswith(_REPLACEMENT_CHAR):
            return ""
        # The emitted tokens become the next decode's context; older ones are dropped.
        del self._ids[: self._read]
        self._read = len(self._ids)
        return text[len(prefix_text) :]


def find_stop_string(
    text: str, num_new_chars: int, stops: list[str], include_stop: bool
) -> tuple[str, int] | None:
    """Look for a stop string that ends within the last `num_new_chars` of `text`.

    Returns (stop, length to keep text at) for the earliest match, or None.
    """
    if not stops or not num_new_chars:
        return None
    best = None
    for stop in stops:
        # A match must end in the new text, so it starts at most len(stop) - 1 before it.
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        i = text.find(stop, start)
        if i != -1 and (best is None or i < best[1]):
            best = (stop, i)
    if best is None:
        return None
    stop, i = best
    return stop, i + len(stop) if include_stop else i
