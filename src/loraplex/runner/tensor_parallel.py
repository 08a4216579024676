"""Tensor parallelism: one model split across the GPUs of a host (`tensor_parallel_size`).

The engine, scheduler, adapter store and server stay in one process. `TensorParallelRunner`
stands where a ModelRunner would: it holds rank 0's runner (the leader) and starts one
worker process per other rank, each running a ModelRunner over its own shard
(models/tensor_parallel.py). Every step's plan, with the adapters it copies into slots,
goes to the workers before the leader launches it; all ranks then run the same kernels
and meet in the layers' collectives (NCCL on GPUs, inside the CUDA graphs; gloo on CPU).
The leader samples and broadcasts the ids; results are read from the leader alone.

Workers are `python -m loraplex.runner.tp_worker` processes (a user's script needs
no `if __name__ == "__main__"` guard) reading pickled messages on their stdin; a worker
whose leader is gone reads the end of that pipe and exits. An adapter is read once, by
the leader's store, and sent whole to each worker, which keeps its part of it
(layers/parallel.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Mapping
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from loraplex.adapters.peft import LoRAAdapter
from loraplex.config import EngineConfig
from loraplex.layers.parallel import TPGroup
from loraplex.runner.model_runner import ModelRunner
from loraplex.runner.step_outputs import LaunchedStep
from loraplex.types import StepPlan, StepResult

logger = logging.getLogger("loraplex")

# How long a rank waits in a collective for the others.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
# A worker that exits while the engine runs leaves every later collective waiting: the
# process ends with this status (a supervisor restarts it) instead of hanging.
WORKER_LOST_STATUS = 70


class TensorParallelRunner:
    def __init__(self, config: EngineConfig, eos_token_ids: tuple[int, ...] = (),
                 shared_page_bytes: int = 0, reserved_bytes: int = 0):
        size = config.tensor_parallel_size
        if dist.is_initialized():
            raise RuntimeError("this process already runs a tensor-parallel engine (one per process)")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self._conns, self._procs = [], []
        for rank in range(1, size):
            proc = subprocess.Popen([sys.executable, "-m", "loraplex.runner.tp_worker"],
                                    stdin=subprocess.PIPE)
            conn = Connection(os.dup(proc.stdin.fileno()), readable=False)
            proc.stdin.close()
            conn.send_bytes(pickle.dumps((config, eos_token_ids, rank, init_method)))
            self._conns.append(conn)
            self._procs.append(proc)
        self._closing = threading.Event()
        self._finalizer = weakref.finalize(self, _stop, self._conns, self._procs, self._closing)
        threading.Thread(target=_watch, args=(self._procs, self._closing), name="loraplex-tp-watch",
                         daemon=True).start()
        try:
            init_group(config, 0, size, init_method)
            self.runner = ModelRunner(config, eos_token_ids, shared_page_bytes, reserved_bytes,
                                      tp=TPGroup(0, size))
        except BaseException:  # a bad checkpoint fails every rank alike: raise the leader's error
            self._closing.set()
            self._finalizer()
            if dist.is_initialized():
                dist.destroy_process_group()
            raise
        self.config = config
        logger.info("tensor parallel: %d ranks", size)

    # What the engine reads of a runner: the leader's.
    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def adapter_targets(self):
        return self.runner.adapter_targets

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    @property
    def lora_slots(self):
        return self.runner.lora_slots

    @property
    def ngram(self):
        return self.runner.ngram

    def launch(self, plan: StepPlan, loads: Mapping[int, LoRAAdapter] | None = None,
               timed: bool = False) -> LaunchedStep:
        loads = loads or {}
        self._send("launch", _for_workers(plan), {slot: _portable(loads[slot]) for slot in plan.lora_loads})
        return self.runner.launch(plan, loads, timed)

    def collect(self, launched: LaunchedStep) -> StepResult:
        return self.runner.collect(launched)

    def run(self, plan: StepPlan, loads: Mapping[int, LoRAAdapter] | None = None) -> StepResult:
        return self.collect(self.launch(plan, loads))

    def synchronize(self) -> None:
        self.runner.synchronize()

    def forget_step_state(self) -> None:
        self._send("forget")
        self.runner.forget_step_state()

    def reset_moe_routing_stats(self) -> None:
        self.runner.reset_moe_routing_stats()

    def moe_experts_per_layer(self) -> float | None:
        return self.runner.moe_experts_per_layer()

    def close(self) -> None:
        """Stop the workers and leave the process group with them (another engine may
        start after). NCCL's teardown waits for every rank: all ranks leave together."""
        if not self._finalizer.alive:
            return
        self._closing.set()
        for conn in self._conns:
            conn.send_bytes(pickle.dumps(("stop",)))
        self.runner.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        self._finalizer()

    def _send(self, *message) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs), 1):
            if proc.poll() is not None:
                _lost(rank, proc.returncode)
            conn.send_bytes(data)


def _for_workers(plan: StepPlan) -> StepPlan:
    """The plan less what only the leader reads (it samples): a chunk's token history
    (penalties) and compiled grammar."""
    if all(c.history is None and c.grammar is None for c in plan.chunks):
        return plan
    return dataclasses.replace(plan, chunks=[dataclasses.replace(c, history=None, grammar=None)
                                             for c in plan.chunks])


def _portable(adapter: LoRAAdapter) -> LoRAAdapter:
    """What a worker needs of an adapter: its slot tensors by value (the leader's are
    views of a pinned pool that stays with it)."""
    names = [n for a, b, _ in adapter.modules.values() for n in (a, b)]
    return LoRAAdapter(key=adapter.key, name=adapter.name, path=adapter.path, rank=adapter.rank,
                       tensors={n: adapter.tensors[n].clone() for n in names},
                       modules=dict(adapter.modules), experts=dict(adapter.experts))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(config: EngineConfig, rank: int, size: int, init_method: str) -> torch.device:
    device = torch.device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method,
                            rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT,
                            **({"device_id": device} if device.type == "cuda" else {}))
    return device


def _watch(procs, closing: threading.Event) -> None:
    while not closing.wait(0.5):
        for rank, proc in enumerate(procs, 1):
            if proc.poll() is not None and not closing.is_set():
                _lost(rank, proc.returncode)


def _lost(rank: int, status: int) -> None:
    logger.critical("tensor-parallel rank %d exited (status %s); the others would wait for it forever: "
                    "ending this process", rank, status)
    os._exit(WORKER_LOST_STATUS)


def _stop(conns, procs, closing: threading.Event) -> None:
    """Close the workers' pipes (a worker that was not told to stop ends at the pipe's
    end) and wait for them."""
    closing.set()
    for conn in conns:
        conn.close()
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

