"""A step's inputs for speculation planned ahead of results: the oracle of
ops/triton/ngram_inputs.py, written per chunk for clarity."""

from __future__ import annotations

import torch


def longest_match(tokens: list[int], n_min: int, n_max: int) -> int:
    """The position after the latest earlier occurrence of the longest suffix of
    `tokens` of n_min..n_max tokens (a token must follow that occurrence), or -1."""
    length = len(tokens)
    best, best_n = -1, 0
    for e in range(1, length):  # an occurrence ending at e - 1, followed by tokens[e]
        m = 0
        while m < n_max and m < e and tokens[e - 1 - m] == tokens[length - 1 - m]:
            m += 1
        if m >= n_min and m >= best_n:
            best, best_n = e, m
    return best


def ngram_inputs(input_ids, positions, slot_mapping, seq_lens, block_tables, query_start_loc,
                 chunks, last_ids, last_shift, history, block_size: int, n_min: int, n_max: int,
                 max_drafts: int):
    qsl = query_start_loc.tolist()
    found = torch.zeros(chunks.shape[0], dtype=torch.int32, device=input_ids.device)
    for c, (src, row, k) in enumerate(chunks.tolist()):
        a, b = qsl[c], qsl[c + 1]
        if src >= 0:
            shift = int(last_shift[src])
            input_ids[a] = last_ids[src]
            positions[a:b] += shift
            seq_lens[c] += shift
            pos = positions[a:b]
            slot_mapping[a:b] = block_tables[c, pos // block_size].long() * block_size + pos % block_size
        if row < 0:
            continue
        known = b - a - k
        history[row, positions[a: a + known]] = input_ids[a: a + known].to(history.dtype)
        if not k:
            continue
        length = int(positions[a + known - 1]) + 1
        tokens = history[row, :length].tolist()
        e = longest_match(tokens, n_min, n_max)
        if e < 0:
            continue
        drafts = history[row, e + torch.arange(k, device=history.device) % (length - e)]
        n = len(drafts)
        input_ids[a + known: a + known + n] = drafts.to(input_ids.dtype)
        history[row, length: length + n] = drafts.clone()
        found[c] = n
    return found


def greedy_accept(best, input_ids, spec, found):
    num_seqs, k1 = best.shape
    verified = torch.full((num_seqs, k1 + 2), -1, dtype=torch.int64, device=best.device)
    added = torch.zeros(num_seqs, dtype=torch.int64, device=best.device)
    shift = torch.zeros(num_seqs, dtype=torch.int32, device=best.device)
    for s, (first, slots, chunk) in enumerate(spec.tolist()):
        n = int(found[chunk])
        a = 0
        while a < n and int(input_ids[first + 1 + a]) == int(best[s, a]):
            verified[s, a] = input_ids[first + 1 + a]
            a += 1
        verified[s, a] = added[s] = best[s, a]
        verified[s, k1], verified[s, k1 + 1] = a, n
        shift[s] = a - slots
    return verified, added, shift
