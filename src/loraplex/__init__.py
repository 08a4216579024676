"""loraplex: one base model, thousands of LoRA adapters, every adapter in the same batch."""

import logging as _logging

from loraplex.engine.args import EngineArgs
from loraplex.entrypoints.llm import LLM
from loraplex.errors import (
    AdapterError,
    AdapterInvalid,
    AdapterNotFound,
    AdapterTooLarge,
    InvalidRequest,
    LoraplexError,
    PromptTooLong,
)
from loraplex.types import (
    CompletionOutput,
    Logprob,
    LoRARequest,
    RequestOutput,
    SamplingParams,
    StructuredOutputs,
)

StructuredOutputsParams = StructuredOutputs  # vLLM's name for it

_logger = _logging.getLogger("loraplex")
if not _logger.handlers:  # one line per event on stderr, like vLLM; silenced via logging
    _handler = _logging.StreamHandler()
    _handler.setFormatter(_logging.Formatter("loraplex %(levelname)s %(message)s"))
    _logger.addHandler(_handler)
    _logger.setLevel(_logging.INFO)

__all__ = [
    "LLM",
    "EngineArgs",
    "AdapterError",
    "AdapterInvalid",
    "AdapterNotFound",
    "AdapterTooLarge",
    "CompletionOutput",
    "InvalidRequest",
    "Logprob",
    "LoRARequest",
    "LoraplexError",
    "PromptTooLong",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputs",
    "StructuredOutputsParams",
]
