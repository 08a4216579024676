"""Proposals on demand for speculation tests: random models' text seldom repeats itself,
so the n-gram proposer, on the host or on the device, would seldom propose."""

from __future__ import annotations


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
