"""Resumable checkpoints: `<out>/checkpoint-<step>/` holds the adapter so far (PEFT
format, float32, so it is exact), and `trainer_state.pt` the optimizer and schedule state,
the step and the RNG states. Batches need no state: each epoch's order is a function of
(seed, epoch) (data.epoch_batches). Resuming from one on CPU continues bit-identically.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from loraplex.train.lora import LoRASpec
from loraplex.train.save import load_adapter_weights, save_adapter

STATE_FILE = "trainer_state.pt"


def checkpoints(out_dir: Path) -> list[Path]:
    """The checkpoints in out_dir, oldest first."""
    found = [p for p in Path(out_dir).glob("checkpoint-*") if re.fullmatch(r"checkpoint-\d+", p.name)]
    return sorted((p for p in found if (p / STATE_FILE).exists()), key=lambda p: int(p.name.split("-")[1]))


def save_checkpoint(path: Path, wrapped, spec: LoRASpec, base_model: str, opt, sched, step: int,
                    fingerprint: dict) -> None:
    save_adapter(path, wrapped, spec, base_model)
    state = {"step": step, "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
             "fingerprint": fingerprint, "rng": torch.get_rng_state(),
             "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
    tmp = path / (STATE_FILE + ".tmp")
    torch.save(state, tmp)
    tmp.replace(path / STATE_FILE)  # written last: a checkpoint without it is incomplete


def load_checkpoint(path: Path, wrapped, opt, sched, fingerprint: dict) -> int:
    """Restore LoRA weights, optimizer, schedule and RNG; returns the step reached."""
    state = torch.load(Path(path) / STATE_FILE, weights_only=True)
    changed = {k for k in set(fingerprint) | set(state["fingerprint"])
               if fingerprint.get(k) != state["fingerprint"].get(k)}
    if changed:
        raise ValueError(f"{path} was written by a run with other {sorted(changed)}")
    load_adapter_weights(path, wrapped)
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    if state["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return state["step"]
