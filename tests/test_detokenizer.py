"""Incremental detokenization and stop strings, on tokenizers built offline.

The oracle for a request's text is what decoding the whole sequence gives:
decode(prompt + output) with decode(prompt) cut off its front. That is exact for the
tokenizers here because their prompts end on a character boundary: byte-level BPE
decodes by concatenating bytes, the word-level tokenizer joins words with one space,
and a Metaspace tokenizer only strips the space before the first word.
"""

from __future__ import annotations

import pytest
import torch

from loraplex.bench.synthetic import write_word_tokenizer
from loraplex.engine import detokenizer as detokenizer_module
from loraplex.engine.detokenizer import IncrementalDetokenizer, find_stop_string


@pytest.fixture(autouse=True, params=["rust", "python"])
def detokenizer_impl(request, monkeypatch):
    """Every test runs against both implementations: tokenizers' DecodeStream and the
    Python fallback."""
    if request.param == "python":
        monkeypatch.setattr(detokenizer_module, "DecodeStream", None)
    return request.param

FFFD = "\ufffd"

CORPUS = [
    "Hello world, this is a small corpus for a tiny tokenizer.",
    "café naïve résumé déjà vu, Ærøskøbing, Straße, façade, São Paulo.",
    "日本語のテキストです。中文也可以。한국어 텍스트.",
    "emoji 😀 🎉 👍🏽 family 👨‍👩‍👧 rocket 🚀 and flags 🇫🇷.",
    "The quick brown fox jumps over the lazy dog. 1234567890!",
]

PROMPTS = [
    "Hello world, tell me:",
    "café 日本",
    "emoji 😀 then",
    "x",
]

CONTINUATIONS = [
    " résumé déjà vu 😀🎉 日本語のテキスト 👨‍👩‍👧 done.",
    "🚀🚀 façade, Straße! 한국어 👍🏽",
    "😀",
    " plain ascii words only",
    "中文也可以。🇫🇷 café",
]


def _train(pre_tokenizer, decoder, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoder
    byte_level = isinstance(decoder, decoders.ByteLevel)
    alphabet = pre_tokenizers.ByteLevel.alphabet() if byte_level else []
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=alphabet,
        special_tokens=["<unk>", "<|eos|>", "<|sep|>"], show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 10 + PROMPTS + CONTINUATIONS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<|eos|>",
        additional_special_tokens=["<|sep|>"], clean_up_tokenization_spaces=False,
    )


@pytest.fixture(scope="module")
def byte_bpe():
    """Byte-level BPE, small enough that emoji and CJK split over several tokens."""
    from tokenizers import decoders, pre_tokenizers

    return _train(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(), 300)


@pytest.fixture(scope="module")
def metaspace_bpe():
    """SentencePiece-style BPE (▁ for spaces, leading space dropped on decode)."""
    from tokenizers import decoders, pre_tokenizers

    return _train(pre_tokenizers.Metaspace(), decoders.Metaspace(), 400)


WORD_VOCAB, WORD_BOS, WORD_EOS = 64, 1, 2


@pytest.fixture(scope="module")
def word_tok(tmp_path_factory):
    """loraplex's synthetic word-level tokenizer, `t<i>` <-> i, loaded with AutoTokenizer."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("word_tok")
    write_word_tokenizer(out, WORD_VOCAB, bos_token_id=WORD_BOS, eos_token_id=WORD_EOS)
    return AutoTokenizer.from_pretrained(str(out))


def oracle(tokenizer, prompt_ids, output_ids, skip_special_tokens=True) -> str:
    """decode(prompt + output) minus decode(prompt): the request's text, decoded at once."""
    full = tokenizer.decode(prompt_ids + output_ids, skip_special_tokens=skip_special_tokens)
    prefix = tokenizer.decode(prompt_ids, skip_special_tokens=skip_special_tokens)
    assert full.startswith(prefix), (prefix, full)
    return full[len(prefix) :]


def run_steps(tokenizer, prompt_ids, output_ids, skip_special_tokens=True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    pieces = []
    for n, t in enumerate(output_ids, 1):
        pieces.append(detok.step(t))
        assert detok.num_tokens == n
    return pieces


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


# -- byte-level BPE --------------------------------------------------------------------


def test_byte_bpe_splits_characters(byte_bpe):
    """Sanity: the test tokenizer really splits multi-byte characters over tokens."""
    ids = encode(byte_bpe, "😀")
    assert len(ids) > 1
    assert FFFD in byte_bpe.decode(ids[:1])
    assert byte_bpe.decode(ids) == "😀"


@pytest.mark.parametrize("prompt", PROMPTS, ids=lambda s: f"p{PROMPTS.index(s)}")
@pytest.mark.parametrize("continuation", CONTINUATIONS, ids=lambda s: f"c{CONTINUATIONS.index(s)}")
def test_byte_bpe_concatenation_matches_full_decode(byte_bpe, prompt, continuation):
    """Joined step() outputs equal the full decode; no step emits U+FFFD for valid text."""
    prompt_ids = encode(byte_bpe, prompt)
    output_ids = encode(byte_bpe, prompt + continuation)[len(prompt_ids) :]
    # Encoding prompt + continuation may merge across the seam; only use it if not.
    if encode(byte_bpe, prompt + continuation)[: len(prompt_ids)] != prompt_ids:
        output_ids = encode(byte_bpe, continuation)
    pieces = run_steps(byte_bpe, prompt_ids, output_ids)
    expected = oracle(byte_bpe, prompt_ids, output_ids)
    assert FFFD not in expected
    assert "".join(pieces) == expected
    assert all(FFFD not in p for p in pieces), pieces


def test_byte_bpe_holds_split_emoji_until_complete(byte_bpe):
    """An emoji split over tokens yields '' for its partial tokens, then the whole emoji."""
    prompt_ids = encode(byte_bpe, "Hello")
    emoji_ids = encode(byte_bpe, "🚀")
    assert len(emoji_ids) >= 2
    pieces = run_steps(byte_bpe, prompt_ids, emoji_ids + emoji_ids)
    k = len(emoji_ids)
    assert pieces == [""] * (k - 1) + ["🚀"] + [""] * (k - 1) + ["🚀"]


def test_byte_bpe_long_output_beyond_context_window(byte_bpe):
    """A long output (far past the 5-token prompt context) still decodes exactly."""
    prompt_ids = encode(byte_bpe, "emoji 😀")
    output_ids = encode(byte_bpe, " " + " ".join(CONTINUATIONS * 4))
    pieces = run_steps(byte_bpe, prompt_ids, output_ids)
    assert "".join(pieces) == oracle(byte_bpe, prompt_ids, output_ids)
    assert all(FFFD not in p for p in pieces)


def test_byte_bpe_prompt_window_starting_mid_character(byte_bpe):
    """A prompt whose last 5 tokens begin inside a character still gives the exact text."""
    emoji_ids = encode(byte_bpe, "x 👨‍👩‍👧")  # many tokens, multi-byte throughout
    assert len(emoji_ids) > 6
    assert FFFD in byte_bpe.decode(emoji_ids[-5:])  # the context window starts mid-character
    a_ids = encode(byte_bpe, " a")
    output_ids = encode(byte_bpe, " ok 😀")
    for j in range(5):  # shift where the last-5-token window starts
        prompt_ids = emoji_ids + a_ids * j
        pieces = run_steps(byte_bpe, prompt_ids, output_ids)
        assert "".join(pieces) == oracle(byte_bpe, prompt_ids, output_ids) == " ok 😀"


@pytest.mark.parametrize("seed", range(4))
def test_byte_bpe_random_tokens(byte_bpe, seed):
    """Random ids (invalid UTF-8 possible): joined text is the full decode, except a
    trailing incomplete character, which is held back."""
    g = torch.Generator().manual_seed(seed)
    special = set(byte_bpe.all_special_ids)
    draws = torch.randint(len(byte_bpe), (300,), generator=g).tolist()
    ids = [t for t in draws if t not in special]
    prompt_ids, output_ids = encode(byte_bpe, "Hello 日本"), ids
    joined = "".join(run_steps(byte_bpe, prompt_ids, output_ids))
    expected = oracle(byte_bpe, prompt_ids, output_ids)
    assert expected.startswith(joined)
    if joined != expected:
        assert expected.endswith(FFFD)


@pytest.mark.parametrize("skip", [True, False])
def test_byte_bpe_special_tokens(byte_bpe, skip):
    """skip_special_tokens drops <|eos|>/<|sep|> from the text; False keeps them."""
    prompt_ids = encode(byte_bpe, "Hello")
    eos, sep = byte_bpe.convert_tokens_to_ids(["<|eos|>", "<|sep|>"])
    output_ids = encode(byte_bpe, " café") + [sep] + encode(byte_bpe, " 😀 ok") + [eos]
    pieces = run_steps(byte_bpe, prompt_ids, output_ids, skip_special_tokens=skip)
    joined = "".join(pieces)
    assert joined == oracle(byte_bpe, prompt_ids, output_ids, skip_special_tokens=skip)
    if skip:
        assert joined == " café 😀 ok"
        assert pieces[-1] == ""
    else:
        assert joined == " café<|sep|> 😀 ok<|eos|>"
        assert pieces[-1] == "<|eos|>"


# -- Metaspace (SentencePiece-style) ---------------------------------------------------


@pytest.mark.parametrize("continuation", CONTINUATIONS, ids=lambda s: f"c{CONTINUATIONS.index(s)}")
def test_metaspace_keeps_leading_spaces(metaspace_bpe, continuation):
    """Word-initial spaces survive, though decoding a token alone would strip them."""
    prompt_ids = encode(metaspace_bpe, "Hello world")
    output_ids = encode(metaspace_bpe, "Hello world" + continuation)[len(prompt_ids) :]
    assert encode(metaspace_bpe, "Hello world" + continuation)[: len(prompt_ids)] == prompt_ids
    pieces = run_steps(metaspace_bpe, prompt_ids, output_ids)
    assert "".join(pieces) == oracle(metaspace_bpe, prompt_ids, output_ids)
    assert "".join(pieces) == continuation


# -- word-level tokenizer --------------------------------------------------------------


def test_word_level_outputs_are_space_t_i(word_tok):
    """Each output token of the word tokenizer adds exactly ' t<i>'."""
    prompt_ids = [WORD_BOS, 5, 6, 7]
    output_ids = [9, 10, 63, 3, 3, 40, 11, 12, 13, 14, 15, 16]
    pieces = run_steps(word_tok, prompt_ids, output_ids)
    assert pieces == [f" t{i}" for i in output_ids]
    assert "".join(pieces) == oracle(word_tok, prompt_ids, output_ids)


@pytest.mark.parametrize("skip", [True, False])
def test_word_level_special_tokens(word_tok, skip):
    """skip_special_tokens drops the bos/eos words from the text."""
    prompt_ids = [WORD_BOS, 5, 6]
    output_ids = [7, WORD_EOS, 8, WORD_BOS, 9, WORD_EOS]
    pieces = run_steps(word_tok, prompt_ids, output_ids, skip_special_tokens=skip)
    shown = [t for t in output_ids if not (skip and t in (WORD_BOS, WORD_EOS))]
    assert "".join(pieces) == "".join(f" t{i}" for i in shown)
    assert "".join(pieces) == oracle(word_tok, prompt_ids, output_ids, skip_special_tokens=skip)


def test_word_level_random_sequences_match_oracle(word_tok):
    """Random prompts/outputs (specials included): joined steps equal the full decode."""
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        plen = int(torch.randint(1, 12, (1,), generator=g))
        prompt_ids = [WORD_BOS] + torch.randint(3, WORD_VOCAB, (plen,), generator=g).tolist()
        output_ids = torch.randint(0, WORD_VOCAB, (30,), generator=g).tolist()
        for skip in (True, False):
            joined = "".join(run_steps(word_tok, prompt_ids, output_ids, skip_special_tokens=skip))
            assert joined == oracle(word_tok, prompt_ids, output_ids, skip_special_tokens=skip)


def test_num_tokens_counts_steps_even_when_text_is_held(byte_bpe):
    """num_tokens counts every step(), including ones that return ''."""
    detok = IncrementalDetokenizer(byte_bpe, encode(byte_bpe, "Hi"))
    assert detok.num_tokens == 0
    ids = encode(byte_bpe, "😀😀")
    for n, t in enumerate(ids, 1):
        detok.step(t)
        assert detok.num_tokens == n


# -- find_stop_string ------------------------------------------------------------------


def test_stop_earliest_match_wins():
    """Among several stops in the new text, the one starting earliest wins."""
    text = "hello STOP world END"
    assert find_stop_string(text, len(text), ["END", "STOP"], False) == ("STOP", 6)
    assert find_stop_string(text, len(text), ["END", "STOP"], True) == ("STOP", 10)
    # Overlapping stops: the earlier start wins even if it is longer.
    assert find_stop_string("abcdef", 6, ["cd", "bcde"], False) == ("bcde", 1)
    # A stop that appears twice is cut at its first appearance.
    assert find_stop_string("x--y--", 6, ["--"], False) == ("--", 1)


def test_stop_only_in_new_text():
    """A stop entirely inside old text is not re-found; one ending in the new text is."""
    text = "aa STOP bb"
    assert find_stop_string(text, 3, ["STOP"], False) is None  # new text: " bb"
    assert find_stop_string(text, 7, ["STOP"], False) == ("STOP", 3)  # new: "STOP bb"
    # Ending on the first new character is new; ending on the last old one is old.
    assert find_stop_string("abSTOP", 1, ["STOP"], False) == ("STOP", 2)
    assert find_stop_string("abSTOPx", 1, ["STOP"], False) is None


def test_stop_straddling_old_and_new_text():
    """A stop that starts in old text and ends in new text is found."""
    text = "hello STOP"  # old: "hello ST", new: "OP"
    assert find_stop_string(text, 2, ["STOP"], False) == ("STOP", 6)
    assert find_stop_string(text, 2, ["STOP"], True) == ("STOP", 10)
    assert find_stop_string(text, 1, ["STOP"], False) == ("STOP", 6)  # only "P" new
    # An old complete match before a new one: the new one is found, not the old.
    text = "STOP and STOP"
    assert find_stop_string(text, 3, ["STOP"], False) == ("STOP", 9)


def test_stop_include_keeps_stop_string():
    """include_stop keeps text through the stop; otherwise text is cut before it."""
    text = "answer: 42\n\nnext"
    stop, keep = find_stop_string(text, len(text), ["\n\n"], True)
    assert (stop, text[:keep]) == ("\n\n", "answer: 42\n\n")
    stop, keep = find_stop_string(text, len(text), ["\n\n"], False)
    assert (stop, text[:keep]) == ("\n\n", "answer: 42")


def test_stop_empty_inputs_return_none():
    """No stops, or no new characters, find nothing; neither does an absent stop."""
    assert find_stop_string("hello STOP", 10, [], False) is None
    assert find_stop_string("hello STOP", 0, ["STOP"], True) is None
    assert find_stop_string("hello", 5, ["STOP"], False) is None
    assert find_stop_string("", 0, ["STOP"], False) is None


def test_stop_with_multibyte_text():
    """Stops and lengths count characters, not bytes (emoji, CJK)."""
    text = "日本😀語。終"
    assert find_stop_string(text, 2, ["。"], False) == ("。", 4)
    assert find_stop_string(text, 4, ["😀"], True) == ("😀", 3)
    assert find_stop_string(text, 3, ["😀"], True) is None
