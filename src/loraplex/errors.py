"""Typed errors raised at loraplex's boundaries.

Every error a caller can cause (a bad adapter, a prompt that does not fit, invalid
sampling parameters, an unsupported model) has its own type, so a server can map it to
a status code and an engine can fail one request while it serves every other one.
"""


class LoraplexError(Exception):
    """Base class of every error loraplex raises on purpose."""


class UnsupportedModel(LoraplexError):
    """The model directory names an architecture or option loraplex cannot serve."""


class ModelLoadError(LoraplexError):
    """Model weights are missing, unexpected or of the wrong shape."""


class InvalidRequest(LoraplexError, ValueError):
    """A request's prompt or sampling parameters cannot be served."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param  # the request field at fault, where one is


class PromptTooLong(InvalidRequest):
    """The prompt leaves no room to generate within max_model_len."""


class EngineFailure(LoraplexError):
    """The engine raised while stepping and this request was ended with it."""


class RequestFailed(LoraplexError):
    """A step failed on one request's input (raised inside the step, naming the request,
    so the engine ends that request alone)."""

    def __init__(self, request_id: str, cause: Exception):
        super().__init__(f"request {request_id!r}: {type(cause).__name__}: {cause}")
        self.request_id = request_id
        self.cause = cause


class AdapterError(LoraplexError):
    """An adapter cannot be served; only the requests that asked for it fail."""

    def __init__(self, adapter: str, reason: str):
        super().__init__(f"adapter {adapter!r}: {reason}")
        self.adapter = adapter
        self.reason = reason


class AdapterNotFound(AdapterError):
    """The adapter's files do not exist."""


class AdapterInvalid(AdapterError):
    """The adapter's files exist but do not describe a LoRA this model can serve."""


class AdapterTooLarge(AdapterInvalid):
    """The adapter's rank exceeds max_lora_rank."""


class LoRADisabled(AdapterError):
    """A request named an adapter but the engine was started with no adapter slots."""


class AdapterUnavailable(AdapterError):
    """The adapter's source could not be reached or did not answer in time."""
