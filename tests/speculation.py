"""Proposals on demand for speculation tests: random models' text seldom repeats itself,
so the n-gram proposer would seldom propose."""

from __future__ import annotations

import torch


class AlwaysSeen:
    """SeenSuffix that always says a proposal would be found."""

    def __init__(self, n_min):
        pass

    def matches(self, prompt, output):
        return True


def repeat_last_on_device(ngram_inputs):
    """ops.ngram_inputs whose proposals repeat each chunk's last known token (history
    rows keep what the real search wrote there)."""

    def propose(input_ids, positions, slot_mapping, seq_lens, block_tables, query_start_loc, chunks,
                *args):
        found = ngram_inputs(input_ids, positions, slot_mapping, seq_lens, block_tables, query_start_loc,
                             chunks, *args)
        qsl = query_start_loc.tolist()
        for c, (_, row, k) in enumerate(chunks.tolist()):
            if k and row >= 0:
                end = qsl[c + 1]
                input_ids[end - k: end] = input_ids[end - k - 1]
                found[c] = k
        return found

    return propose


def oracle_on_device(ngram_inputs, sequences: list[list[int]], vocab: int, right: int = 2):
    """ops.ngram_inputs whose proposals come from known continuations (`sequences`: each
    request's prompt and plain decoding's output): the first `right` of a chunk's
    proposals are the tokens that follow, the rest are not, so verification keeps some
    and rejects the rest. A chunk's sequence is the one its history begins with."""

    def propose(input_ids, positions, slot_mapping, seq_lens, block_tables, query_start_loc, chunks,
                last_ids, last_shift, history, *args):
        found = ngram_inputs(input_ids, positions, slot_mapping, seq_lens, block_tables, query_start_loc,
                             chunks, last_ids, last_shift, history, *args)
        qsl = query_start_loc.tolist()
        for c, (_, row, k) in enumerate(chunks.tolist()):
            if not k or row < 0:
                continue
            first = qsl[c + 1] - k  # the first draft position's row
            length = int(positions[first - 1]) + 1
            known = history[row, :length].tolist()
            seq = next((s for s in sequences if s[:length] == known), None)
            drafts = [] if seq is None else seq[length: length + k]
            drafts = [t if j < right else (t + 1) % vocab for j, t in enumerate(drafts)]
            if drafts:
                values = torch.tensor(drafts)
                input_ids[first: first + len(drafts)] = values.to(input_ids)
                history[row, length: length + len(drafts)] = values.to(history)
            found[c] = len(drafts)
        return found

    return propose
