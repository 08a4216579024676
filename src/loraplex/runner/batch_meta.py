"""A step's input tensors, built into buffers allocated once.

The runner turns a StepPlan into token ids, positions, KV slot mapping, block tables,
query offsets and the per-token adapter slot with its grouping. All but the block
tables are written into one pinned host staging arena (numpy views) and copied to the
device in one copy (runner/staging.py), the block tables in a second; ops receive views
of the device buffers, at addresses fixed by the step's shape, so a step can be
replayed from a CUDA graph.

A step replayed from a graph is padded to the graph's shape (`GraphShape`). A decode
graph's padding is one-token sequences, and so is a short-chunk graph's (verification of
speculated tokens), then empty sequences up to its count; a mixed graph's (prefill chunks
and decodes) is one sequence holding every padding token, then empty sequences.
Padding tokens have no context, no KV slot and no adapter: their attention rows are zero
and they change nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from loraplex.ops.metadata import SHORT_QUERY_MAX, AttentionBatch, LoRABatch, group_tokens
from loraplex.runner.staging import ALIGN, Layout, StagingArena
from loraplex.types import PENDING_TOKEN, StepPlan


@dataclass(frozen=True)
class GraphShape:
    """The padded shape a CUDA graph was captured for: `tokens` tokens in `seqs`
    sequences of at most `query_len` tokens each: 1 in a decode graph, a few in a
    short-chunk graph (seqs == tokens for both), None (any) in a mixed graph. Padded as
    InputBuffers._pad says."""

    tokens: int
    seqs: int
    query_len: int | None

    @property
    def decode(self) -> bool:
        return self.query_len == 1

    @property
    def short(self) -> bool:
        """Decode or short chunks: padded with one-token sequences."""
        return self.query_len is not None


@dataclass
class SpecIndex:
    """A step's speculated chunks (those with draft positions), for verification: the
    logits rows of each (its last known token, then each draft position; a shorter
    chunk's padded with its last), the rows of its draft positions in the input ids,
    (first row, draft positions, chunk index) per chunk, and every chunk's draft count
    as the host knows it."""

    chunks: list[int]  # plan chunk index of each speculated chunk
    k: int  # the most draft positions of any
    rows: torch.Tensor  # [S * (k + 1)] int64
    draft_rows: torch.Tensor  # [S * k] int64
    meta: torch.Tensor  # [S, 3] int64
    counts: torch.Tensor  # [C] int64


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: AttentionBatch
    lora: LoRABatch | None
    sample_rows: torch.Tensor  # [num sampled chunks] token index of each chunk's last token
    sample_chunks: list[int]  # plan chunk index of each sampled row
    spec: SpecIndex | None = None  # a step that verifies proposals
    # Tokens still in flight (PENDING_TOKEN), fed from the previous step's outputs on
    # the device: [2, F] int64 (their rows here, their rows there).
    feed: torch.Tensor | None = None
    # Proposals made on the device (runner/ngram_drafts.py), which feed the pending
    # tokens themselves: per chunk (its row in the previous step's outputs where its
    # first token is pending, else -1; its history row; its draft positions the device
    # fills) [C, 3] int64.
    ngram_chunks: torch.Tensor | None = None


# LoRABatch's device tensors: the layout's fields of the same names.
_LORA_TENSORS = ("token_slot", "sorted_token_ids", "group_slots", "group_starts", "group_ranks", "slot_ranks")


class _Buffer:
    """A device tensor and its pinned host staging twins, used in turn by successive
    steps (as StagingArena's, for the same reason)."""

    def __init__(self, shape, dtype, device):
        if device.type == "cpu":  # no copies: the buffer is the tensor ops read
            self.hosts = [torch.zeros(shape, dtype=dtype)]
            self.dev = self.hosts[0]
        else:
            self.hosts = [torch.zeros(shape, dtype=dtype, pin_memory=True) for _ in range(2)]
            self.dev = torch.zeros(shape, dtype=dtype, device=device)
        self._nps = [h.numpy() for h in self.hosts]
        self._turn = 0
        self.host, self.np = self.hosts[0], self._nps[0]

    def next_turn(self) -> None:
        self._turn = (self._turn + 1) % len(self.hosts)
        self.host, self.np = self.hosts[self._turn], self._nps[self._turn]

    def upload(self, *index) -> torch.Tensor:
        """Copy host[index] to the device; return the device view."""
        index = tuple(slice(0, i) for i in index)
        if self.dev is not self.host:
            self.dev[index].copy_(self.host[index], non_blocking=True)
        return self.dev[index]


class InputBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int,
                 max_loras: int, block_size: int, device: torch.device, max_graph_seqs: int = 0):
        """max_graph_seqs: the most sequences of a short-chunk graph (one per token)."""
        self.block_size = block_size
        self.max_loras = max_loras
        # A mixed graph holds every sequence a step may have, and its padding sequence.
        self.mixed_graph_seqs = max_seqs + 1
        rows = max(max_seqs + 1, max_graph_seqs)
        loras = max(1, max_loras)
        # The arena's most: every field at its largest, the tail's sampled rows and
        # speculation index (at most two rows per token), each field's alignment.
        nbytes = (max_tokens * (3 * 8 + 4 + 8) + (2 * rows + 1) * 4 + (4 * loras + 1) * 4
                  + (max_seqs + 7 * rows + 2 * max_tokens) * 8 + 16 * ALIGN)
        self.arena = StagingArena(nbytes, device)
        self.block_tables = _Buffer((rows, max_blocks_per_seq), torch.int32, device)

    def layout(self, num_tokens: int, num_seqs: int, lora: bool) -> Layout:
        """The arena's fields for a step of this shape: the same offsets (and device
        addresses) for every step of it, so a CUDA graph reads them as captured."""
        i32, i64 = torch.int32, torch.int64
        loras = max(1, self.max_loras)

        def fields():
            base = [("input_ids", i64, num_tokens), ("positions", i64, num_tokens),
                    ("slot_mapping", i64, num_tokens), ("query_start_loc", i32, num_seqs + 1),
                    ("seq_lens", i32, num_seqs)]
            adapters = [("token_slot", i32, num_tokens), ("sorted_token_ids", i64, num_tokens),
                        ("group_slots", i32, loras), ("group_starts", i32, loras + 1),
                        ("group_ranks", i32, loras), ("slot_ranks", i32, loras)]
            return base + (adapters if lora else [])

        return self.arena.layout((num_tokens, num_seqs, lora), fields)

    def prepare(self, plan: StepPlan, slot_ranks: list[int], graph: GraphShape | None = None,
                dora_slots: frozenset[int] | set[int] = frozenset(),
                pending_rows: dict[str, int] | None = None, device_drafts: bool = False) -> StepInputs:
        """Fill the buffers for `plan`; graph: the shape of the CUDA graph that will run
        it, to pad to; pending_rows: each request's row in the previous step's outputs,
        for StepInputs.feed, or with device_drafts (proposals made on the device)
        StepInputs.ngram_chunks."""
        self.arena.next_turn()
        self.block_tables.next_turn()
        bs = self.block_size
        num_tokens, num_seqs = plan.num_tokens, len(plan.chunks)
        lora = any(c.lora_slot >= 0 for c in plan.chunks)
        layout = self.layout(*((graph.tokens, graph.seqs) if graph else (num_tokens, num_seqs)), lora)
        host, dev = layout.np[self.arena.turn], layout.dev
        # Gather per-token values in Python lists, then write each buffer once: a decode
        # step of 32 sequences costs tens of microseconds here.
        token_ids, positions, slots, lora_slots = [], [], [], []
        qsl, seq_lens, sample_chunks, sample_rows = [0], [], [], []
        max_blocks = 1
        tables = self.block_tables.np
        for b, chunk in enumerate(plan.chunks):
            n, start, pages = chunk.num_tokens, chunk.start_pos, chunk.block_ids
            token_ids += chunk.token_ids
            if n == 1:
                positions.append(start)
                slots.append(pages[start // bs] * bs + start % bs)
            elif n <= SHORT_QUERY_MAX:  # verification: plain Python beats numpy's per-call cost
                positions += range(start, start + n)
                slots += [pages[p // bs] * bs + p % bs for p in range(start, start + n)]
            else:
                pos = np.arange(start, start + n)
                positions += pos.tolist()
                slots += (np.asarray(pages)[pos // bs] * bs + pos % bs).tolist()
            if lora:
                lora_slots += [chunk.lora_slot] * n
            tables[b, : len(pages)] = pages
            max_blocks = max(max_blocks, len(pages))
            end = qsl[-1] + n
            if chunk.sample and not chunk.draft_ids:  # speculated chunks: verified apart
                sample_rows.append(end - 1)
                sample_chunks.append(b)
            qsl.append(end)
            seq_lens.append(start + n)
        host["input_ids"][:num_tokens] = token_ids
        host["positions"][:num_tokens] = positions
        host["slot_mapping"][:num_tokens] = slots
        host["query_start_loc"][: num_seqs + 1] = qsl
        host["seq_lens"][:num_seqs] = seq_lens
        if lora:
            host["token_slot"][:num_tokens] = lora_slots
        max_query_len = max(c.num_tokens for c in plan.chunks)
        chunk_starts = qsl
        if graph is not None:
            assert num_tokens <= graph.tokens and num_seqs < graph.seqs + graph.short, (plan, graph)
            assert max_query_len <= (graph.query_len or graph.tokens), "chunks longer than the graph's"
            self._pad(host, num_tokens, num_seqs, graph)
            max_query_len = graph.query_len or graph.tokens  # as captured: the kernels it chose
            num_tokens, num_seqs = graph.tokens, graph.seqs
            # Host copies as the graph sees the batch (real sequences first, then padding).
            qsl = host["query_start_loc"].tolist()
            seq_lens = host["seq_lens"].tolist()
        lora_batch = self._lora(host, dev, num_tokens, slot_ranks, dora_slots) if lora else None
        # Fields no graph reads, after the layout's.
        end, sample_rows_dev = self.arena.tail(layout.end, sample_rows)
        feed = None
        if pending_rows is not None and not device_drafts:
            end, feed = self._feed(plan, chunk_starts, end, pending_rows)
        end, spec, ngram_chunks = self._spec(plan, chunk_starts, end, pending_rows if device_drafts else None)
        self.arena.upload(end)
        attn = AttentionBatch(
            slot_mapping=dev["slot_mapping"],
            query_start_loc=dev["query_start_loc"],
            seq_lens=dev["seq_lens"],
            block_tables=self.block_tables.upload(num_seqs, max_blocks),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            max_query_len=max_query_len,
            max_seq_len=max(seq_lens),
        )
        return StepInputs(
            input_ids=dev["input_ids"],
            positions=dev["positions"],
            attn=attn,
            lora=lora_batch,
            sample_rows=sample_rows_dev,
            sample_chunks=sample_chunks,
            spec=spec,
            feed=feed,
            ngram_chunks=ngram_chunks,
        )

    def _feed(self, plan: StepPlan, qsl: list[int], start: int,
              pending_rows: dict[str, int]) -> tuple[int, torch.Tensor | None]:
        """StepInputs.feed, in the arena's tail from `start`; returns the tail's end too."""
        dst, src = [], []
        for c, chunk in enumerate(plan.chunks):
            if chunk.token_ids[-1] == PENDING_TOKEN:
                assert chunk.num_tokens == 1, "only decode chunks feed a pending token"
                dst.append(qsl[c])
                src.append(pending_rows[chunk.request_id])
        if not dst:
            return start, None
        end, index = self.arena.tail(start, dst + src)
        return end, index.view(2, -1)

    def _spec(self, plan: StepPlan, qsl: list[int], start: int, pending_rows: dict[str, int] | None
              ) -> tuple[int, SpecIndex | None, torch.Tensor | None]:
        """SpecIndex and ngram_chunks (StepInputs), in the arena's tail from `start`
        (qsl: where each chunk's tokens start); returns the tail's end too."""
        chunks = [i for i, c in enumerate(plan.chunks) if c.draft_ids]
        if not chunks and pending_rows is None:
            return start, None, None
        values = []
        if pending_rows is not None:
            for c in plan.chunks:
                src = pending_rows[c.request_id] if c.token_ids[0] == PENDING_TOKEN else -1
                values += (src, c.history_row, len(c.draft_ids) if c.device_drafts else 0)
        k = max((len(plan.chunks[i].draft_ids) for i in chunks), default=0)
        rows, draft_rows, meta = [], [], []
        for i in chunks:
            n = len(plan.chunks[i].draft_ids)
            first = qsl[i] + plan.chunks[i].num_tokens - n - 1  # the last known token's row
            rows += [first + min(j, n) for j in range(k + 1)]
            draft_rows += [first + 1 + min(j, n - 1) for j in range(k)]
            meta += (first, n, i)
        counts = [len(c.draft_ids or ()) for c in plan.chunks]
        end, index = self.arena.tail(start, values + rows + draft_rows + meta + counts)
        parts = index.split([len(values), len(rows), len(draft_rows), len(meta), len(counts)])
        ngram_chunks = parts[0].view(-1, 3) if pending_rows is not None else None
        if not chunks:
            return end, None, ngram_chunks
        return end, SpecIndex(chunks, k, parts[1], parts[2], parts[3].view(-1, 3), parts[4]), ngram_chunks

    def _pad(self, host: dict, num_tokens: int, num_seqs: int, graph: GraphShape) -> None:
        """Pad a batch of num_tokens tokens in num_seqs sequences to `graph`'s shape. The
        padding tokens have no KV slot and no adapter; they are one-token sequences of no
        context in a decode or short-chunk graph, and one sequence of no context in a
        mixed graph, after which the graph's remaining sequences are empty. Either way
        they attend to nothing."""
        tokens = slice(num_tokens, graph.tokens)
        host["input_ids"][tokens] = 0
        host["positions"][tokens] = 0
        host["slot_mapping"][tokens] = -1
        if "token_slot" in host:
            host["token_slot"][tokens] = -1
        ends = host["query_start_loc"][num_seqs + 1: graph.seqs + 1]
        if graph.short:
            ends[:] = np.minimum(np.arange(num_tokens + 1, num_tokens + 1 + len(ends)), graph.tokens)
        else:
            ends[:] = graph.tokens
        host["seq_lens"][num_seqs: graph.seqs] = 0

    def graph_inputs(self, graph: GraphShape, with_lora: bool) -> StepInputs:
        """Static views of the buffers for capturing a CUDA graph of shape `graph`.

        The views cover every row a replay may use; their contents at capture time are
        padding. Kernels read only device tensors, so the graph serves any later batch.
        """
        size = graph.tokens
        layout = self.layout(graph.tokens, graph.seqs, with_lora)
        host, dev = layout.np[self.arena.turn], layout.dev
        host["query_start_loc"][0] = 0
        self._pad(host, 0, 0, graph)
        if with_lora:
            host["group_slots"][:] = -1
            host["group_starts"][:] = 0
            host["group_ranks"][:] = 0
            host["slot_ranks"][:] = 0
            host["sorted_token_ids"][:] = np.arange(size)
        self.arena.upload(layout.end)
        attn = AttentionBatch(
            slot_mapping=dev["slot_mapping"],
            query_start_loc=dev["query_start_loc"],
            seq_lens=dev["seq_lens"],
            block_tables=self.block_tables.upload(graph.seqs, self.block_tables.np.shape[1]),
            query_start_loc_cpu=host["query_start_loc"].tolist(),
            seq_lens_cpu=[0] * graph.seqs,
            # Picks the kernels: one token per sequence, a few, or chunks of any length.
            max_query_len=graph.query_len or size,
            max_seq_len=0,
        )
        lora = LoRABatch(**{name: dev[name] for name in _LORA_TENSORS}, groups=[]) if with_lora else None
        return StepInputs(
            input_ids=dev["input_ids"],
            positions=dev["positions"],
            attn=attn,
            lora=lora,
            sample_rows=dev["input_ids"][:0],
            sample_chunks=[],
        )

    def _lora(self, host: dict, dev: dict, num_tokens: int, slot_ranks: list[int],
              dora_slots: frozenset[int] | set[int]) -> LoRABatch:
        order, groups = group_tokens(host["token_slot"][:num_tokens], slot_ranks, self.max_loras)
        host["sorted_token_ids"][:num_tokens] = order
        g = len(groups)
        host["group_slots"][:] = -1
        host["group_ranks"][:] = 0
        host["group_slots"][:g] = [x.slot for x in groups]
        host["group_ranks"][:g] = [x.rank for x in groups]
        host["group_starts"][: g + 1] = [x.start for x in groups] + [groups[-1].end]
        host["group_starts"][g + 1:] = groups[-1].end
        host["slot_ranks"][:] = 0
        host["slot_ranks"][: len(slot_ranks)] = slot_ranks
        return LoRABatch(
            **{name: dev[name] for name in _LORA_TENSORS},
            groups=groups,
            host_token_slot=host["token_slot"][:num_tokens].copy(),
            dora=any(x.slot in dora_slots for x in groups),
        )
