"""Pieces of OpenAI responses built from RequestOutputs: streamed text deltas, logprobs,
usage and the loraplex receipt."""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.types import CompletionOutput, LoRARequest, RequestOutput


@dataclass
class Delta:
    text: str
    first_token: int  # index of the first token this chunk reports logprobs for
    first: bool  # the choice's first chunk


class ChoiceState:
    """What one streamed choice has sent so far.

    Text that could still turn out to be the start of a stop string is held back (the
    last len(longest stop) - 1 characters) until more text or the end rules it out, so a
    client never receives text that the stop string later removes.
    """

    def __init__(self, index: int, stop: str | list[str] | None, logprobs: int | None):
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        self.index = index
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.want_logprobs = logprobs is not None
        self.text_sent = 0
        self.tokens_sent = 0
        self.first_chunk = True
        self.done = False

    def advance(self, c: CompletionOutput) -> Delta | None:
        """The text (and tokens) of sample `c` not sent yet, or None; the delta of a
        finished sample is its last."""
        if self.done:
            return None
        finished = c.finish_reason is not None
        end = len(c.text) if finished else max(self.text_sent, len(c.text) - self.hold)
        new_tokens = len(c.token_ids) > self.tokens_sent
        if end == self.text_sent and not finished and not (self.want_logprobs and new_tokens):
            return None
        delta = Delta(c.text[self.text_sent : end], self.tokens_sent, self.first_chunk)
        self.text_sent, self.tokens_sent, self.first_chunk = end, len(c.token_ids), False
        self.done = finished
        return delta


def _top(pos: dict, k: int) -> list:
    """The position's k most likely tokens (the chosen one may be beyond them)."""
    return sorted((lp for lp in pos.values() if lp.rank is not None and lp.rank <= k),
                  key=lambda lp: lp.rank)


def completion_logprobs(c: CompletionOutput, start: int, k: int) -> dict:
    """OpenAI completions format, for tokens start.. of c, with the top k per position."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = 0
    for tid, pos in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
        chosen = pos[tid]
        tokens.append(chosen.decoded_token or "")
        token_lps.append(chosen.logprob)
        tops.append({lp.decoded_token or "": lp.logprob for lp in _top(pos, k)})
        offsets.append(offset)
        offset += len(chosen.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(c: CompletionOutput, start: int, k: int) -> dict:
    """OpenAI chat format, for tokens start.. of c, with the top k per position."""

    def entry(lp):
        text = lp.decoded_token or ""
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}

    content = []
    for tid, pos in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
        content.append({**entry(pos[tid]), "top_logprobs": [entry(lp) for lp in _top(pos, k)]})
    return {"content": content}


def usage(outs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outs)}}


def _ms(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round((b - a) * 1e3, 3)


def receipt(request_id: str, lora: LoRARequest | None, outs: list[RequestOutput],
            replica: str | None = None) -> dict:
    """Which adapter served the request, from which tier (and on which replica, behind
    an ingress), and its timings and tokens. With several prompts, times are the
    slowest prompt's and tokens are summed."""
    ms = [o.metrics for o in outs]

    def slowest(values):
        values = [v for v in values if v is not None]
        return max(values) if values else None

    load = slowest(m.adapter_load_time for m in ms)
    return {
        "request_id": request_id,
        "adapter": lora.lora_name if lora else None,
        "adapter_content_id": next((m.adapter_content_id for m in ms if m.adapter_content_id), None),
        "adapter_source": next((m.adapter_source for m in ms if m.adapter_source), None),
        "replica": replica,
        "adapter_load_ms": None if load is None else round(load * 1e3, 3),
        "queue_ms": slowest(_ms(m.arrival_time, m.first_scheduled_time) for m in ms),
        "ttft_ms": slowest(_ms(m.arrival_time, m.first_token_time) for m in ms),
        "e2e_ms": slowest(_ms(m.arrival_time, m.finished_time) for m in ms),
        "preemptions": sum(m.num_preemptions for m in ms),
        "cached_tokens": sum(o.num_cached_tokens for o in outs),
        "speculated_tokens": sum(m.num_draft_tokens for m in ms),
        "speculated_tokens_accepted": sum(m.num_accepted_tokens for m in ms),
        **usage(outs),
    }
