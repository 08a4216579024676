"""Adapters from their sources into host memory, without stalling the engine loop.

    remote source --download--> local disk cache --read+validate--> pinned host memory
                                                    (worker pool)   (HostCache, LRU)
    host memory --copy stream--> GPU slot (runner; the scheduler assigns slots)

submit() hands the engine a ticket per request at once. If the adapter's content is
already in host memory the ticket is ready; otherwise a load runs on a worker thread
(one per distinct source, however many requests wait for it) and the request waits in
the queue while everything else keeps running. poll(), on the engine thread, moves
finished loads into host memory; take_resolved() reports the tickets that became ready
or failed.
Only the engine thread touches the HostCache; workers only read, parse and validate.

A LoRARequest from a path is bound to the content it was first read as: while that is
in host memory the request gets it, whatever happened to the files since; read again
(after an eviction), files that now hold other content fail its requests rather than
serve other weights under its name. Another name reads what the files hold now. (A
registry name resolves to its latest version at each request instead.)
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loraplex.adapters.host_cache import HostCache
from loraplex.adapters.manifest import content_id
from loraplex.adapters.peft import (
    FINITE_MARK,
    WEIGHTS_FILE,
    AdapterTargets,
    LoRAAdapter,
    read_adapter_dir,
    shown,
    to_canonical,
)
from loraplex.adapters.pinned_pool import PinnedPool
from loraplex.adapters.registry import Registry
from loraplex.adapters.safetensors_io import TensorFile
from loraplex.adapters.sources import AdapterSource, DiskCache, download, resolve
from loraplex.errors import AdapterError, AdapterInvalid, AdapterNotFound, AdapterUnavailable
from loraplex.types import LoRARequest

# Adapter files read (and checked) at once; see AdapterManager.__init__.
PARALLEL_READS = int(os.environ.get("LORAPLEX_PARALLEL_READS", 2))


@dataclass(eq=False)
class AdapterTicket:
    """One request's claim on an adapter, from submit() until release()."""

    lora: LoRARequest
    source: AdapterSource
    state: str = "loading"  # -> "ready" | "failed"
    content_id: str | None = None
    tier: str | None = None  # where the content was: "host", "disk" or "remote"
    load_time: float | None = None  # seconds to read it into host memory
    error: AdapterError | None = None
    owner: object = None  # the engine's request

    @property
    def ready(self) -> bool:
        return self.state == "ready"


@dataclass(eq=False)
class _Load:
    source: AdapterSource
    future: Future
    started: float
    tickets: list[AdapterTicket] = field(default_factory=list)


class AdapterManager:
    def __init__(
        self,
        targets: AdapterTargets | Mapping[str, tuple[int, int]],
        max_rank: int,
        dtype: torch.dtype,
        host: HostCache,
        registry: Registry | None = None,
        disk_cache: DiskCache | None = None,
        workers: int = 4,
        timeout: float = 120.0,
        parallel_reads: int = PARALLEL_READS,
    ):
        if not isinstance(targets, AdapterTargets):
            targets = AdapterTargets(targets)
        self.targets, self.max_rank, self.dtype = targets, max_rank, dtype
        self.limits = targets.file_limits(max_rank)  # weights files past these are not read
        self.host = host
        self.pool = None
        if torch.cuda.is_available():  # one pinned buffer per host adapter and per loader
            # Sized for dense adapters: expert LoRA is re-laid out into its own buffer anyway.
            largest = AdapterTargets(targets.projections).max_bytes(max_rank, dtype.itemsize)
            self.pool = PinnedPool(host.capacity + workers, largest + (1 << 20), host.max_bytes)
            host.on_drop = self._drop
        self.registry = registry
        self.disk_cache = disk_cache
        self.timeout = timeout
        self._workers = ThreadPoolExecutor(workers, thread_name_prefix="loraplex-adapter")
        # Reading a file into memory and checking its bytes run at memory bandwidth: eight
        # such threads at once made the engine thread's steps ~7x slower (each of its
        # cache misses waits behind them; benchmarks/loader_interference.py), while one or
        # two read more adapters per second than a GPU's slots take. Downloads are not
        # bounded by this.
        self._reading = threading.Semaphore(parallel_reads)
        self._loads: dict[str, _Load] = {}  # source key -> the load in progress
        self._content_of: dict[str, tuple[str, str]] = {}  # source uri -> (its key when read, content id)
        self._bound: dict[str, str] = {}  # LoRARequest.key -> content id, for path sources
        self._resolved: list[AdapterTicket] = []  # since the last take_resolved()
        self._finished = threading.Event()  # a worker finished a load
        self.num_loads: Counter[str] = Counter()  # loads by tier read from: disk / remote

    # -- engine thread -------------------------------------------------------------------

    def submit(self, lora: LoRARequest) -> AdapterTicket:
        """A ticket for `lora` (raises AdapterNotFound at once for what is known missing)."""
        self.poll()  # so content that just arrived counts as in memory
        source, cid = self._resolve(lora)
        ticket = AdapterTicket(lora, source)
        if cid is not None and cid in self.host:
            self.host.ref(cid)
            self._ready(ticket, cid, "host", None)
            return ticket
        self._start(source, cid).tickets.append(ticket)
        return ticket

    def poll(self) -> None:
        """Finish loads that completed or timed out; their tickets become ready or
        failed and wait in take_resolved()."""
        resolved = self._resolved
        now = time.monotonic()
        for key, load in list(self._loads.items()):
            if load.future.done():
                del self._loads[key]
                try:
                    adapter, tier, seconds = load.future.result()
                except Exception as e:
                    self._fail(load, _adapter_error(load.source, e))
                else:
                    self._content_of[load.source.uri] = (load.source.key, adapter.key)
                    self.num_loads[tier] += 1
                    ready, changed = [], []  # (requests bound to other content must not get this)
                    for t in load.tickets:
                        bound = self._bound_to(t.lora, t.source)
                        (ready if bound in (None, adapter.key) else changed).append(t)
                    self.host.put(adapter, refs=len(ready))
                    for t in ready:
                        self._ready(t, adapter.key, tier, seconds)
                    for t in changed:
                        t.state, t.error = "failed", self._changed(t.source)
                resolved += load.tickets
            elif now - load.started > self.timeout:
                del self._loads[key]  # the worker's eventual result is dropped
                load.future.add_done_callback(self._drop_late)
                self._fail(load, AdapterUnavailable(load.source.name,
                                                    f"not loaded within {self.timeout:g} s"))
                resolved += load.tickets

    def take_resolved(self) -> list[AdapterTicket]:
        """Tickets resolved since the last call (the engine acts on them)."""
        self.poll()
        out, self._resolved = self._resolved, []
        return out

    def wait(self, timeout: float) -> None:
        """Sleep until a worker finishes a load (or `timeout` seconds)."""
        if self._loads:
            self._finished.wait(timeout)
        self._finished.clear()

    @property
    def num_loading(self) -> int:
        return len(self._loads)

    def release(self, ticket: AdapterTicket) -> None:
        """The ticket's request ended: drop its reference, or stop waiting for the load."""
        if ticket.state == "ready":
            self.host.unref(ticket.content_id)
            ticket.state = "released"
        elif ticket.state == "loading":
            load = self._loads.get(ticket.source.key)
            if load is not None and ticket in load.tickets:
                load.tickets.remove(ticket)
            ticket.state = "released"

    def get(self, content_id: str) -> LoRAAdapter:
        return self.host.get(content_id)

    def load(self, lora: LoRARequest) -> AdapterTicket:
        """Load `lora` into host memory now (blocking) and return its ready ticket, with a
        reference the caller must release(). Raises the adapter's typed error."""
        ticket = self.submit(lora)
        deadline = time.monotonic() + self.timeout + 1
        while ticket.state == "loading" and time.monotonic() < deadline:
            self.wait(0.05)
            self.poll()
        if ticket.error is not None:
            raise ticket.error
        return ticket

    def prefetch(self, lora: LoRARequest) -> Future:
        """Start loading `lora` without waiting; the future gives its content id (or the
        adapter's error) once read. Any thread may wait on it; poll() files it."""
        source, cid = self._resolve(lora)
        out: Future = Future()
        if cid is not None and cid in self.host:
            out.set_result(cid)
            return out
        load = self._start(source, cid)
        bound = self._bound_to(lora, source)

        def done(f: Future) -> None:
            if f.exception() is not None:
                out.set_exception(_adapter_error(source, f.exception()))
            elif bound not in (None, f.result()[0].key):
                out.set_exception(self._changed(source))
            else:
                out.set_result(f.result()[0].key)

        load.future.add_done_callback(done)
        return out

    def pin(self, lora: LoRARequest) -> str:
        """Keep `lora` in host memory for good (pre-warmed, never evicted)."""
        ticket = self.load(lora)
        self.host.pinned.add(ticket.content_id)
        self.release(ticket)
        return ticket.content_id

    def forget(self, lora: LoRARequest) -> str | None:
        """Drop what is known of `lora` (unload; its name is then free to load what its
        files hold by then); returns its content id if it was read."""
        cid = self._bound.pop(lora.key, None)
        try:
            source = resolve(lora, self.registry)
        except AdapterError:
            source = None
        if source is not None:
            read = self._content_of.pop(source.uri, (None, None))[1]
            cid = source.content_id or cid or read
        if cid is not None:
            self.host.pinned.discard(cid)
            self.host.forget(cid)
        return cid

    def _resolve(self, lora: LoRARequest) -> tuple[AdapterSource, str | None]:
        """Its source, and its content id if known without reading it: for a request
        bound to content (_bound_to) that content while it is in host memory, even where
        its files changed or are gone."""
        bound = self._bound.get(lora.key) if lora.lora_path else None
        try:
            source = resolve(lora, self.registry)
        except AdapterNotFound:
            if bound is None or bound not in self.host:
                raise
            return AdapterSource(lora.lora_name, lora.lora_path, remote=False), bound
        if source.content_id is not None:
            return source, source.content_id
        known, cid = self._content_of.get(source.uri, (None, None))
        cid = cid if known == source.key else None
        if bound is None or bound == cid or bound in self.host:
            return source, bound or cid
        if cid is not None:  # the files hold other content now, known without reading them
            raise self._changed(source)
        return source, None  # read again: poll() fails its tickets if the content changed

    def _bound_to(self, lora: LoRARequest, source: AdapterSource) -> str | None:
        """The content `lora` was first read as, for a source without a registry content id."""
        return self._bound.get(lora.key) if source.content_id is None else None

    def _ready(self, ticket: AdapterTicket, cid: str, tier: str, seconds: float | None) -> None:
        ticket.state, ticket.content_id, ticket.tier, ticket.load_time = "ready", cid, tier, seconds
        if ticket.source.content_id is None:
            self._bound.setdefault(ticket.lora.key, cid)

    @staticmethod
    def _changed(source: AdapterSource) -> AdapterInvalid:
        return AdapterInvalid(source.name, f"the files at {shown(source.uri)} changed since this adapter "
                                           "was loaded; load them under a new name")

    # -- loads -----------------------------------------------------------------------------

    def _start(self, source: AdapterSource, cid: str | None) -> _Load:
        load = self._loads.get(source.key)
        if load is None:
            future = self._workers.submit(self._read, source, cid)
            future.add_done_callback(lambda _: self._finished.set())
            load = self._loads[source.key] = _Load(source, future, time.monotonic())
        return load

    def _drop_late(self, future: Future) -> None:
        if future.exception() is None:
            self._drop(future.result()[0])

    def _drop(self, adapter: LoRAAdapter) -> None:
        if adapter.pinned_buffer is not None:
            self.pool.give(adapter.pinned_buffer, adapter.last_copy)
            adapter.pinned_buffer = None

    def _fail(self, load: _Load, error: AdapterError) -> None:
        for t in load.tickets:
            t.state, t.error = "failed", error

    def _read(self, source: AdapterSource, cid: str | None) -> tuple[LoRAAdapter, str, float]:
        """Worker thread: fetch, parse, validate, pin. Touches no shared state."""
        t0 = time.perf_counter()
        local, tier, staged = source.uri, "disk", None
        # Content-addressed copies were verified when they were written (registry publish,
        # disk-cache commit): their content id, and finiteness where they hold FINITE_MARK,
        # need no second pass over the bytes (which would also slow the engine thread:
        # benchmarks/LOG.md).
        verified = source.content_id is not None and not source.remote
        if source.remote:
            cached = self.disk_cache.lookup(cid) if (self.disk_cache and cid) else None
            if cached is not None:
                local, verified = str(cached), True
            else:
                staged = self.disk_cache.staging() if self.disk_cache else Path(tempfile.mkdtemp())
                local, tier = str(staged), "remote"
        slab = self.pool.take(_weights_size(local)) if self.pool is not None else None
        try:
            if staged is not None:
                download(source, staged, self.timeout, self.limits.file_bytes)
            with self._reading:
                # No pool buffer (the pool spent, or a float32 file too big for one): pageable
                # memory. Page-locking per load took ~50 ms a call under load and stalled
                # every kernel launch meanwhile (1,000 cold adapters: 9 calls, 475 ms); a
                # pageable buffer costs the slot copy ~10 ms of synchronous copying instead.
                config, tensors = read_adapter_dir(source.name, local, False, slab, self.limits)
                cid = cid if verified else content_id(config, tensors)
                if source.content_id is not None and cid != source.content_id:
                    raise AdapterInvalid(source.name,
                                         f"content is {cid}, the registry says {source.content_id}")
                checked = verified and (Path(local) / FINITE_MARK).is_file()
                adapter = to_canonical(cid, source.name, source.uri, config, tensors,
                                       self.targets, self.max_rank, self.dtype,
                                       check_finite=not checked)
            if slab is not None and _lives_in(adapter, slab):
                adapter.pinned_buffer, slab = slab, None
            elif slab is not None:  # the file did not fit, or was cast to another dtype
                self.pool.give(slab, None)
                slab = None
        except BaseException:
            if slab is not None:
                self.pool.give(slab, None)
            if staged is not None:
                shutil.rmtree(staged, ignore_errors=True)
            raise
        if staged is not None:
            if self.disk_cache is not None:
                self.disk_cache.commit(staged, cid)
            else:
                shutil.rmtree(staged, ignore_errors=True)
        return adapter, tier, time.perf_counter() - t0


def _adapter_error(source: AdapterSource, error: BaseException) -> AdapterError:
    """A failed read as the adapter's typed error: a bug or an unexpected format is still
    this adapter's alone."""
    if isinstance(error, AdapterError):
        return error
    return AdapterInvalid(source.name, f"cannot load: {type(error).__name__} {shown(str(error))}")


def _weights_size(adapter_dir: str) -> int:
    try:
        return os.path.getsize(os.path.join(adapter_dir, WEIGHTS_FILE))
    except OSError:
        return 0  # remote (not downloaded yet) or missing: read_adapter_dir reports it


def _lives_in(adapter: LoRAAdapter, buf: torch.Tensor) -> bool:
    """Its dense tensors are those of the file read into `buf` (an experts-only adapter
    keeps none of them: its expert tensors are re-laid out into a buffer of their own)."""
    t = adapter.tensors
    return isinstance(t, TensorFile) and (
        t.buffer.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr())
