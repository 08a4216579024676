"""Where the engine thread's host time goes: a sampling profiler in pure Python.

A daemon thread reads the engine thread's Python stack every few milliseconds
(`sys._current_frames`) and its scheduler state from /proc (R: running or runnable,
S: sleeping, e.g. waiting for the GIL or a lock, D: in the kernel). Samples taken
inside `within` (a function name) are counted by their innermost loraplex line and
innermost line overall: a stall shows as one line with many samples; contention for
the GIL as time spread over every line, mostly in state S.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter


class StackSampler:
    def __init__(self, thread: threading.Thread, within: str = "_launch", interval: float = 0.002):
        self.thread, self.within, self.interval = thread, within, interval
        self.samples = 0
        self.inside = 0
        self.states: Counter[str] = Counter()  # thread state of the samples inside `within`
        self.lines: Counter[tuple[str, str, str]] = Counter()
        self._stop = threading.Event()
        self._runner = threading.Thread(target=self._run, name="loraplex-stack-sampler", daemon=True)

    def __enter__(self) -> StackSampler:
        self._runner.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._runner.join()

    def _run(self) -> None:
        stat = f"/proc/self/task/{self.thread.native_id}/stat"
        while not self._stop.wait(self.interval):
            frame = sys._current_frames().get(self.thread.ident)
            if frame is None:
                continue
            self.samples += 1
            stack = []
            while frame is not None:
                stack.append(frame)
                frame = frame.f_back
            if not any(f.f_code.co_name == self.within for f in stack):
                continue
            self.inside += 1
            self.states[_state(stat)] += 1
            ours = next((f for f in stack if "loraplex" in f.f_code.co_filename), stack[0])
            self.lines[(_where(ours), _where(stack[0]), _state(stat))] += 1

    def report(self, top: int = 25) -> dict:
        """The most sampled (loraplex line, innermost line, state) inside `within`."""
        return {
            "interval_ms": self.interval * 1e3, "samples": self.samples, "inside": self.inside,
            "states": dict(self.states),
            "top": [{"count": n, "loraplex": a, "innermost": b, "state": s}
                    for (a, b, s), n in self.lines.most_common(top)],
        }


def _where(frame) -> str:
    path = frame.f_code.co_filename
    short = path[path.rfind("loraplex/") :] if "loraplex/" in path else path.rsplit("/", 2)[-1]
    return f"{short}:{frame.f_lineno} {frame.f_code.co_name}"


def _state(stat_path: str) -> str:
    try:
        with open(stat_path) as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


if __name__ == "__main__":  # a self-check: a busy loop inside `_launch` shows up
    def _launch(seconds):
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    with StackSampler(threading.current_thread()) as s:
        _launch(0.2)
    print(s.report(3))
