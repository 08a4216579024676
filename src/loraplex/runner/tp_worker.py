"""A tensor-parallel worker rank (`python -m loraplex.runner.tp_worker`, started by
runner/tensor_parallel.py): its shard's ModelRunner, fed the leader's messages on stdin
(pickled: its setup, then ("launch", plan, slot loads), ("forget",), ("stop",)) until
told to stop or the pipe ends. Nothing imports this module, so running it as __main__
loads it once.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import sys
import time
import traceback
from collections import deque
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from loraplex.layers.parallel import TPGroup
from loraplex.runner.model_runner import ModelRunner
from loraplex.runner.tensor_parallel import init_group

logger = logging.getLogger("loraplex")
STARTUP_FAILURE_GRACE_S = 5.0


def main() -> None:
    """A worker rank: its shard's runner, fed the leader's plans until told to stop."""
    conn = Connection(sys.stdin.fileno(), writable=False)
    config, eos_token_ids, rank, init_method = pickle.loads(conn.recv_bytes())
    try:
        device = init_group(config, rank, config.tensor_parallel_size, init_method)
        if device.type == "cuda":
            config = dataclasses.replace(config, device=str(device))
        runner = ModelRunner(config, eos_token_ids, tp=TPGroup(rank, config.tensor_parallel_size))
    except Exception:
        # The leader most likely failed the same way (same checkpoint, same code): give it
        # the time to raise its own error before the exit of this rank ends its process.
        logger.error("tensor-parallel rank %d failed to start\n%s", rank, traceback.format_exc())
        time.sleep(STARTUP_FAILURE_GRACE_S)
        sys.exit(1)
    # Host input buffers are reused every other step (runner/batch_meta.py): like the
    # leader, which collects a step before preparing the one after next, a worker waits
    # for the step before the previous one before it prepares the next.
    in_flight: deque[torch.cuda.Event] = deque()
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:  # the leader is gone
            return
        kind = message[0]
        if kind == "stop":  # the leader leaves the group now too
            runner.close()
            dist.destroy_process_group()
            return
        try:
            if kind == "forget":
                runner.forget_step_state()
            elif kind == "launch":
                if len(in_flight) == 2:
                    in_flight.popleft().synchronize()
                runner.launch(message[1], message[2])
                if device.type == "cuda":
                    done = torch.cuda.Event()
                    done.record()
                    in_flight.append(done)
        except Exception:  # the leader fails the same step the same way (same plan, same code)
            logger.warning("tensor-parallel rank %d: step failed\n%s", rank, traceback.format_exc())


if __name__ == "__main__":
    main()
