"""Host time and GPU time of copying one adapter into a GPU slot (the engine thread does
this between steps for every adapter that is not resident).

Llama-3.1-8B shapes, rank 16 on all seven projections (84 MB in bf16), the adapter's
tensors views of one pinned buffer as a loaded adapter's are. Compares one copy_ per
tensor with the batched copy (adapters/slots.py BATCHED_COPIES).

    python benchmarks/slot_load.py
"""

from __future__ import annotations

import statistics
import time

import torch

from loraplex.adapters import slots as slots_mod
from loraplex.adapters.peft import LoRAAdapter

LAYERS, HIDDEN, INTER, KV, RANK, SLOTS = 32, 4096, 14336, 1024, 16, 32
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
SIZES = {"q_proj": HIDDEN, "k_proj": KV, "v_proj": KV, "o_proj": HIDDEN, "gate_proj": INTER,
         "up_proj": INTER, "down_proj": HIDDEN}
IN = {"qkv_proj": HIDDEN, "o_proj": HIDDEN, "gate_up_proj": HIDDEN, "down_proj": INTER}


class Layer:  # what the slots read of a LoRALinear
    def __init__(self, in_features, output_sizes):
        self.in_features, self.output_sizes, self.lora_scale = in_features, output_sizes, None

    def slice_rows(self, i):
        start = sum(self.output_sizes[:i])
        return slice(start, start + self.output_sizes[i])


class Proj:
    def __init__(self, layer, i):
        self.layer, self.slice = layer, i


def main():
    dev = torch.device("cuda")
    projections = {}
    for n in range(LAYERS):
        for fused, parts in FUSED.items():
            layer = Layer(IN[fused], [SIZES[p] for p in parts])
            for i, p in enumerate(parts):
                projections[f"model.layers.{n}.{p}"] = Proj(layer, i)
    slots = slots_mod.LoRASlotBuffers(projections, SLOTS, RANK, torch.bfloat16, dev)
    numel = sum(RANK * (p.layer.in_features + p.layer.output_sizes[p.slice]) for p in projections.values())
    buf = torch.randn(numel, pin_memory=True).to(torch.bfloat16).pin_memory()
    weights, off = {}, 0
    for m, p in projections.items():
        a_n, b_n = RANK * p.layer.in_features, p.layer.output_sizes[p.slice] * RANK
        weights[m] = (buf[off:off + a_n].view(RANK, -1), buf[off + a_n:off + a_n + b_n].view(-1, RANK))
        off += a_n + b_n
    tensors = {f"{m}.{ab}": t for m, pair in weights.items() for ab, t in zip("AB", pair)}
    modules = {m: (f"{m}.A", f"{m}.B", 2.0) for m in weights}  # scaling 2: alpha = 2r
    adapter = LoRAAdapter("k", "a", "", RANK, tensors, modules)
    stream = torch.cuda.Stream()
    for batched in (False, True, False, True):
        slots_mod.BATCHED_COPIES = batched
        host, gpu = [], []
        for it in range(12):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            with torch.cuda.stream(stream):
                start.record()
                t0 = time.perf_counter()
                slots.load(it % SLOTS, adapter)
                host.append(time.perf_counter() - t0)
                end.record()
            end.synchronize()
            gpu.append(start.elapsed_time(end))
        want = torch.cat([w.flatten() * s for a, b in weights.values() for w, s in ((a, 1), (b, 2))]).to(dev)
        got = torch.cat([torch.cat((p.layer.lora_a[p.slice, 11 % SLOTS].flatten(),
                                    p.layer.lora_b[11 % SLOTS, p.layer.slice_rows(p.slice)].flatten()))
                         for p in projections.values()])
        assert torch.equal(got, want), "slot contents differ from the adapter"
        label = "batched" if batched else "per tensor"
        print(f"{label:10s}: host {statistics.median(host[2:]) * 1e3:7.2f} ms, "
              f"GPU {statistics.median(gpu[2:]):7.2f} ms per load ({buf.nbytes / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
