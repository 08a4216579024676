"""JSONL training data -> token ids and labels (-100 where no loss is taken) -> batches.

Two record shapes:
- {"prompt": str, "completion": str}: the prompt tokenized as the tokenizer does for a
  text (BOS if it adds one), the completion without special tokens, then EOS. Loss on the
  completion and EOS. The two halves are tokenized apart so the boundary is exact.
- {"messages": [{"role", "content"}, ...]}: the tokenizer's chat template. Loss on each
  assistant turn: the text its rendering adds after the generation prompt (its content and
  the template's end of turn, so the model learns to stop). Boundaries come from
  rendering prefixes of the conversation; each rendered piece is tokenized on its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

IGNORE = -100


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]


def _ids(tokenizer, text: str, special: bool) -> list[int]:
    return tokenizer(text, add_special_tokens=special)["input_ids"] if text else []


def encode_prompt_completion(tokenizer, prompt: str, completion: str) -> Example:
    p = _ids(tokenizer, prompt, True)
    c = _ids(tokenizer, completion, False)
    eos = tokenizer.eos_token_id
    if eos is not None and (not c or c[-1] != eos):
        c.append(eos)
    return Example(p + c, [IGNORE] * len(p) + c)


def _render(tokenizer, messages, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def encode_messages(tokenizer, messages: list[dict]) -> Example:
    if tokenizer.chat_template is None:
        raise ValueError("records with 'messages' need a tokenizer with a chat template")
    # Cut points in the full rendering: (start, end) of each assistant turn.
    full = _render(tokenizer, messages, False)
    cuts: list[tuple[int, bool]] = []  # (end of piece, trained)
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        before = _render(tokenizer, messages[:i], True) if i else ""
        through = _render(tokenizer, messages[: i + 1], False)
        if not (through.startswith(before) and full.startswith(through)):
            raise ValueError("the chat template renders earlier turns differently once later ones follow "
                             "(e.g. it drops reasoning): give one record per assistant turn")
        cuts += [(len(before), False), (len(through), True)]
    cuts.append((len(full), False))
    ids, labels, start = [], [], 0
    for end, trained in cuts:
        piece = _ids(tokenizer, full[start:end], False)
        ids += piece
        labels += piece if trained else [IGNORE] * len(piece)
        start = max(start, end)
    # A template may end a turn without EOS (e.g. a bare newline); ending on an assistant
    # turn then also trains EOS, or the model never learns to stop.
    eos = tokenizer.eos_token_id
    if messages and messages[-1].get("role") == "assistant" and eos is not None and eos not in ids[-2:]:
        ids.append(eos)
        labels.append(eos)
    return Example(ids, labels)


def encode(tokenizer, record: dict) -> Example:
    if "messages" in record:
        return encode_messages(tokenizer, record["messages"])
    if "prompt" in record and "completion" in record:
        return encode_prompt_completion(tokenizer, record["prompt"], record["completion"])
    raise ValueError(f"a record needs 'prompt' and 'completion', or 'messages': got keys {sorted(record)}")


def load_examples(path: str | Path, tokenizer, max_seq_len: int) -> list[Example]:
    """Every record of the JSONL file, truncated to max_seq_len; records left with no
    trained token (all prompt) are dropped."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            ex = encode(tokenizer, json.loads(line))
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path}:{n}: {err}") from err
        ex = Example(ex.input_ids[:max_seq_len], ex.labels[:max_seq_len])
        if any(t != IGNORE for t in ex.labels[1:]):
            out.append(ex)
    if not out:
        raise ValueError(f"{path}: no record with a token to train on")
    return out


def collate(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids, attention_mask, labels (IGNORE on padding)."""
    n = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), n), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), n), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), n), dtype=torch.long)
    for i, e in enumerate(examples):
        k = len(e.input_ids)
        ids[i, :k], labels[i, :k], mask[i, :k] = torch.tensor(e.input_ids), torch.tensor(e.labels), 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def pack(examples: list[Example], bounds: bool = False, length: int | None = None,
         slots: int | None = None, pad_id: int = 0) -> dict[str, torch.Tensor | int]:
    """The examples as one row [1, total]: position ids restart at each example, which
    transformers reads as the examples' attention boundaries (no attention_mask given);
    the label of each example's first token is IGNORE (the previous example's last token
    would otherwise predict it). Same loss and gradients as collate(), no padding.

    bounds: also the boundaries as train/attention.py reads them (`cu_seq_lens_q/k`,
    where each example starts, then the row's end; `max_length_q/k`). For a fixed shape
    (a CUDA graph's): `length` pads the row with one more example of pad_id (labels
    IGNORE), `slots` repeats the row's end until there are slots + 1 boundaries, and the
    longest length is the row's. "tokens" counts the examples' tokens, padding left out.
    A row that is one example gets no boundaries: attention takes it as a causal row
    (cuDNN's kernel on a GPU, 1.7x flash's variable-length one at 16K tokens)."""
    lens = [len(e.input_ids) for e in examples]
    total = sum(lens)
    ids = [t for e in examples for t in e.input_ids]
    labels = [t for e in examples for t in e.labels]
    if length is not None and length > total:
        lens.append(length - total)
        ids += [pad_id] * lens[-1]
        labels += [IGNORE] * lens[-1]
    positions = torch.cat([torch.arange(n) for n in lens])
    labels = torch.tensor(labels)
    labels[positions == 0] = IGNORE
    batch = {"input_ids": torch.tensor(ids)[None], "position_ids": positions[None], "labels": labels[None]}
    if bounds:
        batch["tokens"] = total
    if bounds and len(lens) > 1:  # (one example filling the row is a causal row: no bounds)
        ends = torch.tensor([0, *lens]).cumsum(0)
        if slots is not None:
            if slots + 1 < len(ends):
                raise ValueError(f"{len(lens)} examples in a row of {slots} slots")
            ends = torch.cat([ends, ends[-1:].expand(slots + 1 - len(ends))])
        cu = ends.to(torch.int32)
        longest = sum(lens) if length is not None else max(lens)
        batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    return batch


def num_tokens(batch: dict[str, torch.Tensor | int]) -> int:
    """Tokens of a collated or packed batch, padding left out."""
    if "tokens" in batch:
        return batch["tokens"]
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else batch["input_ids"].numel()


def epoch_batches(num_examples: int, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """The example indices of each batch of an epoch: a permutation seeded by (seed,
    epoch), so a resumed run sees the same batches without saving any data-loader state."""
    perm = torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
    return [perm[i : i + batch_size].tolist() for i in range(0, num_examples, batch_size)]
