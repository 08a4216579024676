"""What a sampled row may ask beyond temperature, top-k and top-p, applied to its logits
before sampling, in vLLM's order: logit_bias, then the repetition, frequency and
presence penalties (min_p acts after temperature: runner/sampler.py).

- logit_bias: logits[t] += bias[t].
- repetition penalty r (Hugging Face's): a token in the prompt or the output so far has
  its logit divided by r if positive, multiplied by r if not.
- frequency penalty f, presence penalty p (OpenAI's): logits[t] -= f * count[t] +
  p * (count[t] > 0), count over the output so far.

The output so far may end with a token the step in flight samples (async scheduling):
its id is read from that step's device output, so no row waits for the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loraplex.device import to_device
from loraplex.types import SamplingParams


@dataclass
class LogitRules:
    logit_bias: dict[int, float] = field(default_factory=dict)
    repetition: float = 1.0
    frequency: float = 0.0
    presence: float = 0.0
    prompt_ids: list[int] = field(default_factory=list)  # (repetition penalty only)
    output_ids: list[int] = field(default_factory=list)  # known output tokens
    pending_row: int | None = None  # the in-flight token's row in the last step's output
    min_p: float = 0.0

    @property
    def penalized(self) -> bool:
        return self.repetition != 1.0 or self.frequency != 0.0 or self.presence != 0.0

    @staticmethod
    def of(sp: SamplingParams, prompt_ids: list[int], output_ids: list[int],
           pending_row: int | None) -> LogitRules | None:
        """The rules of a row sampled with `sp`, or None when it asks none."""
        if not (sp.logit_bias or sp.min_p or sp.repetition_penalty != 1.0 or sp.frequency_penalty
                or sp.presence_penalty):
            return None
        return LogitRules(dict(sp.logit_bias or {}), sp.repetition_penalty, sp.frequency_penalty,
                          sp.presence_penalty, prompt_ids if sp.repetition_penalty != 1.0 else [],
                          output_ids, pending_row, sp.min_p)


def apply_rules(logits: torch.Tensor, rules: list[LogitRules | None],
                last_ids: torch.Tensor | None) -> None:
    """Apply each row's rules to logits [N, V] in place (rows without rules untouched).
    last_ids: the last step's sampled ids on the device (rows' pending_row index it)."""
    device = logits.device
    bias = [(i, t, b) for i, r in enumerate(rules) if r is not None for t, b in r.logit_bias.items()]
    if bias:
        rows, cols, values = zip(*bias)
        index = to_device([rows, cols], torch.int64, device)
        logits.index_put_((index[0], index[1]), to_device(values, torch.float32, device).to(logits.dtype),
                          accumulate=True)
    penalized = [i for i, r in enumerate(rules) if r is not None and r.penalized]
    if not penalized:
        return
    vocab = logits.shape[1]
    counts = torch.zeros(len(penalized), vocab, dtype=torch.float32, device=device)
    seen_in_prompt = torch.zeros(len(penalized), vocab, dtype=torch.bool, device=device)
    out_rows = [j for j, i in enumerate(penalized) for _ in rules[i].output_ids]
    if out_rows:
        ids = [t for i in penalized for t in rules[i].output_ids]
        index = to_device([out_rows, ids], torch.int64, device)
        counts.index_put_((index[0], index[1]), torch.ones(len(ids), device=device), accumulate=True)
    pending = [(j, rules[i].pending_row) for j, i in enumerate(penalized) if rules[i].pending_row is not None]
    if pending:
        index = to_device(list(zip(*pending)), torch.int64, device)
        counts.index_put_((index[0], last_ids[index[1]].long()), torch.ones(len(pending), device=device),
                          accumulate=True)
    prompt_rows = [j for j, i in enumerate(penalized) for _ in rules[i].prompt_ids]
    if prompt_rows:
        ids = [t for i in penalized for t in rules[i].prompt_ids]
        index = to_device([prompt_rows, ids], torch.int64, device)
        seen_in_prompt[index[0], index[1]] = True
    row_index = to_device(penalized, torch.int64, device)
    values = logits[row_index].float()
    rep, freq, pres = (to_device([getattr(rules[i], name) for i in penalized], torch.float32, device)[:, None]
                       for name in ("repetition", "frequency", "presence"))
    seen = seen_in_prompt | (counts > 0)
    values = torch.where(seen, torch.where(values > 0, values / rep, values * rep), values)
    values -= freq * counts + pres * (counts > 0)
    logits[row_index] = values.to(logits.dtype)


def min_p_mask(probs: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """[N, V] True where a token's probability is under min_p times its row's largest
    (min_p 0: nothing)."""
    threshold = to_device(min_p, torch.float32, probs.device)[:, None] * probs.amax(dim=-1, keepdim=True)
    return probs < threshold
