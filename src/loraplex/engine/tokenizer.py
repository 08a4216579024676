"""The tokenizer a model directory declares."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerFast


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
