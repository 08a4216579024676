"""A step's input tensors, built into buffers allocated once.

The runner turns a StepPlan into token ids, positions, KV slot mapping, block tables,
query offsets and the per-token adapter slot with its grouping. Everything is written
into pinned host staging buffers (numpy views) and copied to the device buffers in one
pass; ops receive views of the device buffers, so their addresses never change and a
step can be replayed from a CUDA graph.

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
    # Proposals made on the device (runner/ngram_drafts.py): per chunk (its row in the
    # previous step's outputs where its first token is pending, else -1; its history
    # row; its draft positions the device fills) [C, 3] int64.
    ngram_chunks: torch.Tensor | None = None


class _Buffer:
    """A device tensor and its pinned host staging twins, used in turn by successive
    steps: a step's host-to-device copies may not have run when the host fills the next
    step's inputs (they queue behind the step's adapter slot copies, milliseconds for a
    large adapter), and with one step in flight the twin a step writes was last read by
    the step before the previous one, whose results the engine has already collected."""

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
        """Write the other host twin from now on (called once per step)."""
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
        i32, i64 = torch.int32, torch.int64
        self.input_ids = _Buffer(max_tokens, i64, device)
        self.positions = _Buffer(max_tokens, i64, device)
        self.slot_mapping = _Buffer(max_tokens, i64, device)
        self.query_start_loc = _Buffer(rows + 1, i32, device)
        self.seq_lens = _Buffer(rows, i32, device)
        self.block_tables = _Buffer((rows, max_blocks_per_seq), i32, device)
        self.sample_rows = _Buffer(max_seqs, i64, device)
        self.token_slot = _Buffer(max_tokens, i32, device)
        self.sorted_token_ids = _Buffer(max_tokens, i64, device)
        self.group_slots = _Buffer(max(1, max_loras), i32, device)
        self.group_starts = _Buffer(max(1, max_loras) + 1, i32, device)
        self.group_ranks = _Buffer(max(1, max_loras), i32, device)
        self.slot_ranks = _Buffer(max(1, max_loras), i32, device)
        # SpecIndex and ngram_chunks, one upload: their rows are at most two per token.
        self.spec = _Buffer(7 * rows + 2 * max_tokens, i64, device)
        self._buffers = [b for b in vars(self).values() if isinstance(b, _Buffer)]

    def prepare(self, plan: StepPlan, slot_ranks: list[int], graph: GraphShape | None = None,
                dora_slots: frozenset[int] | set[int] = frozenset(),
                pending_rows: dict[str, int] | None = None) -> StepInputs:
        """Fill the buffers for `plan`; graph: the shape of the CUDA graph that will run
        it, to pad to; pending_rows (proposals made on the device): each request's row
        in the previous step's outputs, for StepInputs.ngram_chunks."""
        for b in self._buffers:
            b.next_turn()
        bs = self.block_size
        num_tokens, num_seqs = plan.num_tokens, len(plan.chunks)
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
            lora_slots += [chunk.lora_slot] * n
            tables[b, : len(pages)] = pages
            max_blocks = max(max_blocks, len(pages))
            end = qsl[-1] + n
            if chunk.sample and not chunk.draft_ids:  # speculated chunks: verified apart
                sample_rows.append(end - 1)
                sample_chunks.append(b)
            qsl.append(end)
            seq_lens.append(start + n)
        self.input_ids.np[:num_tokens] = token_ids
        self.positions.np[:num_tokens] = positions
        self.slot_mapping.np[:num_tokens] = slots
        self.token_slot.np[:num_tokens] = lora_slots
        self.sample_rows.np[: len(sample_rows)] = sample_rows
        self.query_start_loc.np[: num_seqs + 1] = qsl
        self.seq_lens.np[:num_seqs] = seq_lens
        max_query_len = max(c.num_tokens for c in plan.chunks)
        spec, ngram_chunks = self._spec(plan, qsl, pending_rows)
        if graph is not None:
            assert num_tokens <= graph.tokens and num_seqs < graph.seqs + graph.short, (plan, graph)
            assert max_query_len <= (graph.query_len or graph.tokens), "chunks longer than the graph's"
            self._pad(num_tokens, num_seqs, graph)
            max_query_len = graph.query_len or graph.tokens  # as captured: the kernels it chose
            num_tokens, num_seqs = graph.tokens, graph.seqs
            # Host copies as the graph sees the batch (real sequences first, then padding).
            qsl = self.query_start_loc.np[: num_seqs + 1].tolist()
            seq_lens = self.seq_lens.np[:num_seqs].tolist()

        attn = AttentionBatch(
            slot_mapping=self.slot_mapping.upload(num_tokens),
            query_start_loc=self.query_start_loc.upload(num_seqs + 1),
            seq_lens=self.seq_lens.upload(num_seqs),
            block_tables=self.block_tables.upload(num_seqs, max_blocks),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            max_query_len=max_query_len,
            max_seq_len=max(seq_lens),
        )
        return StepInputs(
            input_ids=self.input_ids.upload(num_tokens),
            positions=self.positions.upload(num_tokens),
            attn=attn,
            lora=self._lora(plan, num_tokens, slot_ranks, dora_slots),
            sample_rows=self.sample_rows.upload(len(sample_chunks)),
            sample_chunks=sample_chunks,
            spec=spec,
            ngram_chunks=ngram_chunks,
        )

    def _spec(self, plan: StepPlan, qsl: list[int],
              pending_rows: dict[str, int] | None) -> tuple[SpecIndex | None, torch.Tensor | None]:
        """SpecIndex and ngram_chunks (StepInputs), written and uploaded together."""
        chunks = [i for i, c in enumerate(plan.chunks) if c.draft_ids]
        if not chunks and pending_rows is None:
            return None, None
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
        values += rows + draft_rows + meta + [len(c.draft_ids or ()) for c in plan.chunks]
        self.spec.np[: len(values)] = values
        parts = self.spec.upload(len(values)).split(
            [len(values) - len(rows) - len(draft_rows) - len(meta) - len(plan.chunks),
             len(rows), len(draft_rows), len(meta), len(plan.chunks)])
        ngram_chunks = parts[0].view(-1, 3) if pending_rows is not None else None
        if not chunks:
            return None, ngram_chunks
        return SpecIndex(chunks, k, parts[1], parts[2], parts[3].view(-1, 3), parts[4]), ngram_chunks

    def _pad(self, num_tokens: int, num_seqs: int, graph: GraphShape) -> None:
        """Pad a batch of num_tokens tokens in num_seqs sequences to `graph`'s shape. The
        padding tokens have no KV slot and no adapter; they are one-token sequences of no
        context in a decode or short-chunk graph, and one sequence of no context in a
        mixed graph, after which the graph's remaining sequences are empty. Either way
        they attend to nothing."""
        tokens = slice(num_tokens, graph.tokens)
        self.input_ids.np[tokens] = 0
        self.positions.np[tokens] = 0
        self.slot_mapping.np[tokens] = -1
        self.token_slot.np[tokens] = -1
        ends = self.query_start_loc.np[num_seqs + 1 : graph.seqs + 1]
        if graph.short:
            ends[:] = np.minimum(np.arange(num_tokens + 1, num_tokens + 1 + len(ends)), graph.tokens)
        else:
            ends[:] = graph.tokens
        self.seq_lens.np[num_seqs : graph.seqs] = 0

    def graph_inputs(self, graph: GraphShape, with_lora: bool) -> StepInputs:
        """Static views of the buffers for capturing a CUDA graph of shape `graph`.

        The views cover every row a replay may use; their contents at capture time are
        padding. Kernels read only device tensors, so the graph serves any later batch.
        """
        size = graph.tokens
        self.query_start_loc.np[0] = 0
        self._pad(0, 0, graph)
        self.group_slots.np[:] = -1
        self.group_starts.np[:] = 0
        self.group_ranks.np[:] = 0
        self.sorted_token_ids.np[:size] = np.arange(size)
        n_groups = len(self.group_slots.np)
        qsl = self.query_start_loc.np[: graph.seqs + 1].tolist()
        attn = AttentionBatch(
            slot_mapping=self.slot_mapping.upload(size),
            query_start_loc=self.query_start_loc.upload(graph.seqs + 1),
            seq_lens=self.seq_lens.upload(graph.seqs),
            block_tables=self.block_tables.upload(graph.seqs, self.block_tables.np.shape[1]),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=[0] * graph.seqs,
            # Picks the kernels: one token per sequence, a few, or chunks of any length.
            max_query_len=graph.query_len or size,
            max_seq_len=0,
        )
        self.slot_ranks.np[:] = 0
        lora = LoRABatch(
            token_slot=self.token_slot.upload(size),
            sorted_token_ids=self.sorted_token_ids.upload(size),
            group_slots=self.group_slots.upload(n_groups),
            group_starts=self.group_starts.upload(n_groups + 1),
            group_ranks=self.group_ranks.upload(n_groups),
            slot_ranks=self.slot_ranks.upload(n_groups),
            groups=[],
            active=True,
        ) if with_lora else None
        return StepInputs(
            input_ids=self.input_ids.upload(size),
            positions=self.positions.upload(size),
            attn=attn,
            lora=lora,
            sample_rows=self.sample_rows.upload(0),
            sample_chunks=[],
        )

    def _lora(self, plan: StepPlan, num_tokens: int, slot_ranks: list[int],
              dora_slots: frozenset[int] | set[int]) -> LoRABatch | None:
        if all(c.lora_slot < 0 for c in plan.chunks):
            return None
        order, groups = group_tokens(self.token_slot.np[:num_tokens], slot_ranks, self.max_loras)
        self.sorted_token_ids.np[:num_tokens] = order
        g = len(groups)
        self.group_slots.np[:] = -1
        self.group_ranks.np[:] = 0
        self.group_slots.np[:g] = [x.slot for x in groups]
        self.group_ranks.np[:g] = [x.rank for x in groups]
        self.group_starts.np[: g + 1] = [x.start for x in groups] + [groups[-1].end]
        self.group_starts.np[g + 1 :] = groups[-1].end
        self.slot_ranks.np[: len(slot_ranks)] = slot_ranks
        return LoRABatch(
            token_slot=self.token_slot.upload(num_tokens),
            sorted_token_ids=self.sorted_token_ids.upload(num_tokens),
            group_slots=self.group_slots.upload(len(self.group_slots.np)),
            group_starts=self.group_starts.upload(len(self.group_starts.np)),
            group_ranks=self.group_ranks.upload(len(self.group_ranks.np)),
            slot_ranks=self.slot_ranks.upload(len(self.slot_ranks.np)),
            groups=groups,
            host_token_slot=self.token_slot.np[:num_tokens].copy(),
            dora=any(x.slot in dora_slots for x in groups),
        )
