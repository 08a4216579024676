"""A training micro-step (forward and backward) captured once in a CUDA graph and replayed.

At a thousand tokens a MoE model's step is bound by the host: each layer queues some
hundred kernels and autograd nodes while the GPU waits for them (Qwen3-30B-A3B's shapes,
2 layers, 1K tokens, H100: 13-19 ms a step eager, 5.2 from a graph). Replaying a graph
queues the whole forward and backward in one call.

What capture needs, and what replay then means:
- Fixed shapes: a batch is copied into static inputs of the shape captured; `GraphedSteps`
  keeps one capture per row length (the trainer pads rows to a few lengths), all in one
  memory pool: a replay overwrites what the last one left there (its loss, its
  gradients), so those are read or copied out first.
- No host syncs between the forward's first kernel and the backward's last: the MoE
  pair sort and `train/attention.py` are sync-free for this, and the loss skips nothing
  by boolean indexing (`chunked_loss_sum(..., sync_free=True)`).
- Gradients: each graph's backward writes its micro-step's own, allocated late in the
  pool as eager autograd allocates them (the step's peak is eager's, plus the side
  stream's cuBLAS workspace); `GraphedSteps`
  hands them to `.grad` and accumulates micro-steps outside the pool.
- No randomness (LoRA training here has no dropout).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

WARMUP_STEPS = 2  # eager steps before capture: Triton compiles, cuBLAS workspaces, autotuning

Batch = dict[str, object]  # tensors, and ints (max_length_q) fixed per capture
SHORTEST_ROW = 256


def row_length(tokens: int) -> int:
    """The captured row length a row of `tokens` is padded to: 256 x 2^k or 384 x 2^k,
    so padding adds at most half and a run captures a few graphs."""
    n = SHORTEST_ROW
    while n < tokens:
        n = n * 3 // 2 if n & (n - 1) == 0 else n * 4 // 3
    return n


class NotCapturable(RuntimeError):
    """The step waits for the host (e.g. a per-expert loop reading its row counts, a
    quantized base's expert slices): a graph cannot hold it."""


class CapturedStep:
    """loss_fn(batch).backward() captured for the batch's shapes. `replay(batch)` returns
    the loss, and `grads` hold the gradients of that one micro-step (None for a
    parameter the loss does not reach): tensors in the graph's pool, which the next
    replay of any graph sharing the pool overwrites."""

    def __init__(self, loss_fn: Callable[[Batch], torch.Tensor], params: list[torch.nn.Parameter],
                 batch: Batch, pool=None, side: torch.cuda.Stream | None = None):
        self.inputs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        held = [p.grad for p in params]  # this step's gradients so far, kept out of the way
        # Warm-up and capture on one side stream: cuBLAS keeps a workspace per stream
        # (2 x 32 MiB on sm_90, counted as allocated memory), so a stream each would
        # hold two more.
        side = side or torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
            for i in range(WARMUP_STEPS):
                for p in params:
                    p.grad = None
                # The last warm-up may not wait for the host, as the captured step could not.
                torch.cuda.set_sync_debug_mode("error" if i == WARMUP_STEPS - 1 else 0)
                try:
                    loss_fn(self.inputs).backward()
                except RuntimeError as err:
                    if "synchroniz" not in str(err):
                        raise
                    torch.cuda.current_stream().wait_stream(side)
                    for p, g in zip(params, held, strict=True):
                        p.grad = g
                    raise NotCapturable(str(err)) from err
                finally:
                    torch.cuda.set_sync_debug_mode(0)
        torch.cuda.current_stream().wait_stream(side)
        for p in params:
            p.grad = None
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool, stream=side):
            self.loss = loss_fn(self.inputs)
            self.loss.backward()
        self.grads = [p.grad for p in params]
        for p, g in zip(params, held, strict=True):
            p.grad = g

    def replay(self, batch: Batch) -> torch.Tensor:
        for k, v in batch.items():
            mine = self.inputs[k]
            if not isinstance(v, torch.Tensor):
                if v != mine:
                    raise ValueError(f"captured with {k}={mine}, got {v}")
            elif v.shape != mine.shape:
                raise ValueError(f"captured for {k} of shape {tuple(mine.shape)}, got {tuple(v.shape)}")
            else:
                mine.copy_(v, non_blocking=True)
        self.graph.replay()
        return self.loss


class GraphedSteps:
    """`steps(batch)`: loss_fn(batch).backward() as autograd would run it, gradients added
    to the parameters' `.grad` (None ones set), replayed from one CapturedStep per shape of
    the batch's tensors (captured on first use, all in one memory pool). Returns the loss,
    valid until the next call.

    The captured backward allocates each gradient late, as eager autograd does, so the
    pool reuses activations' memory for it and a step's peak is the eager step's. After a
    first micro-step `.grad` is the graph's own tensor (no copy); a second one, of any
    shape, first copies the gradients out of the pool and then adds its own to them.
    A step that waits for the host (NotCapturable) runs eagerly from then on."""

    def __init__(self, loss_fn: Callable[[Batch], torch.Tensor], params: list[torch.nn.Parameter]):
        self.loss_fn, self.params = loss_fn, params
        self.steps: dict[tuple, CapturedStep] = {}
        self.pool = None
        self.side = torch.cuda.Stream() if torch.cuda.is_available() else None
        self.in_pool: list[torch.Tensor] = []  # the .grad tensors that are a graph's outputs
        self.eager = False

    def __call__(self, batch: Batch) -> torch.Tensor:
        key = tuple((k, tuple(v.shape) if isinstance(v, torch.Tensor) else v)
                    for k, v in sorted(batch.items()))
        mine = {id(g) for g in self.in_pool}
        for p in self.params:  # gradients a replay would overwrite: out of the pool first
            if p.grad is not None and id(p.grad) in mine:
                p.grad = p.grad.clone()
        self.in_pool = []
        if key not in self.steps and not self.eager:
            try:
                self.steps[key] = CapturedStep(self.loss_fn, self.params, batch, self.pool, self.side)
                self.pool = self.pool or self.steps[key].graph.pool()
            except NotCapturable as err:
                logger.warning("training steps run eagerly: the step waits for the host (%s)",
                               str(err).splitlines()[0][:200])
                self.eager = True
        if self.eager:
            loss = self.loss_fn(batch)
            loss.backward()
            return loss.detach()
        step = self.steps[key]
        loss = step.replay(batch)
        for p, g in zip(self.params, step.grads, strict=True):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g
                self.in_pool.append(g)
            else:
                p.grad.add_(g)
        return loss
