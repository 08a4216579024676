"""The offline API, shaped like vLLM's `LLM` so its users switch by changing an import."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import fields

from tqdm.auto import tqdm

from loraplex.engine.args import EngineArgs
from loraplex.errors import InvalidRequest
from loraplex.types import LoRARequest, RequestOutput, SamplingParams

PromptType = str | list[int] | dict


class LLM:
    """Generate from a base model and many LoRA adapters in one batch.

    The keyword arguments are EngineArgs' fields (loraplex.engine.args: vLLM's engine
    arguments, each with its default and help), e.g. max_loras, max_lora_rank,
    max_model_len, dtype, enforce_eager, async_scheduling.
    """

    def __init__(self, model: str, **kwargs):
        unknown = kwargs.keys() - {f.name for f in fields(EngineArgs)}
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword arguments {sorted(unknown)}; valid: "
                            f"{', '.join(f.name for f in fields(EngineArgs)[1:])}")
        self.engine = EngineArgs(model, **kwargs).create_engine()
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    def close(self) -> None:
        """Stop the engine's worker processes (tensor parallelism) now, not at exit."""
        self.engine.close()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the prompts' order.

        A prompt is a string, a list of token ids, or {"prompt_token_ids": [...]}.
        sampling_params and lora_request are one for all prompts or a list parallel to
        them; a None lora_request means the base model. Invalid prompts and bad adapters
        raise before any prompt is queued (when the batch has more distinct adapters
        than host memory holds, an adapter that fails to load later raises its error
        once the other requests are aborted).
        """
        prompts = _as_prompt_list(prompts)
        n = len(prompts)
        params = _broadcast(sampling_params or SamplingParams(), n, "sampling_params")
        loras = _broadcast(lora_request, n, "lora_request")

        # Adapters that fit host memory together are loaded first (errors raise before
        # anything is queued, and the schedule does not depend on load timing); more
        # than that stream through host memory as requests reach them.
        distinct = {lora.key: lora for lora in loras if lora is not None}
        manager = self.engine.adapters
        if manager is not None and 0 < len(distinct) <= manager.host.capacity:
            for lora in distinct.values():
                self.engine.load_adapter(lora)

        queued = []
        try:
            for prompt, sp, lora in zip(prompts, params, loras):
                text, ids = self._tokenize(prompt)
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, ids, sp, lora, prompt=text)
                queued.append(request_id)
        except Exception:
            for request_id in queued:
                self.engine.abort_request(request_id)
            raise

        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=n, desc="Generating", unit="req", disable=not use_tqdm, leave=False)
        while len(finished) < n:
            for out in self.engine.step():
                if out.error is not None:
                    for request_id in queued:
                        self.engine.abort_request(request_id)
                    while self.engine.has_unfinished_requests():
                        self.engine.step()  # the step in flight
                    bar.close()
                    raise out.error
                if out.finished:
                    finished[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [finished[request_id] for request_id in queued]

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            raise InvalidRequest("a dict prompt needs 'prompt_token_ids' or 'prompt'")
        return None, list(prompt)


def _as_prompt_list(prompts) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _broadcast(value, n: int, name: str) -> list:
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != n:
            raise InvalidRequest(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n
