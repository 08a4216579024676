"""Host time and GPU time of copying one adapter into a GPU slot (the engine thread does
this between steps for every adapter that is not resident).

Llama-3.1-8B shapes, rank 16 on all seven projections (84 MB in bf16), the adapter's
tensors views of one pinned buffer as a loaded adapter's are. Compares one copy_ per
tensor with the batched copy (adapters/slots.py BATCHED_COPIES).

    python -m benchmarks.slot_load [--loads 12]

Figure: benchmarks/RESULTS.md, "Slot loads" (host and GPU ms per load).
"""

from __future__ import annotations

import statistics
import time

from benchmarks import harness

RANK, SLOTS = 16, 32
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


class Layer:  # what the slots read of a LoRALinear
    def __init__(self, in_features, output_sizes):
        self.in_features, self.output_sizes, self.lora = in_features, output_sizes, None

    def slice_rows(self, i):
        start = sum(self.output_sizes[:i])
        return slice(start, start + self.output_sizes[i])


class Proj:
    def __init__(self, layer, i):
        self.layer, self.slice = layer, i


def build_parser():
    p = harness.parser(__doc__)
    p.add_argument("--model", default="llama-3.1-8b", help="a dense bundled config (default: %(default)s)")
    p.add_argument("--loads", type=int, default=12, help="loads per variant (the first 2 untimed)")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    import torch

    # Engine internals: the slot buffers, their batched-copy switch, the adapter record,
    # and (below) LoRALinear's slots (`lora.a` / `lora.b`) the check reads back.
    from loraplex.adapters import slots as slots_mod
    from loraplex.adapters.peft import LoRAAdapter

    shape = harness.model_shape(args.model)
    sizes = {m.rsplit(".", 1)[1]: io for m, io in shape.modules().items() if m.startswith("model.layers.0.")}
    dev = torch.device("cuda")
    projections = {}
    for n in range(shape.layers):
        for parts in FUSED.values():
            layer = Layer(sizes[parts[0]][0], [sizes[p][1] for p in parts])
            for i, p in enumerate(parts):
                prefix = "mlp" if p in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                projections[f"model.layers.{n}.{prefix}.{p}"] = Proj(layer, i)
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
    results = []
    saved = slots_mod.BATCHED_COPIES
    try:
        for batched in (False, True, False, True):
            slots_mod.BATCHED_COPIES = batched
            host, gpu = [], []
            for it in range(args.loads):
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
            last = (args.loads - 1) % SLOTS
            want = torch.cat([w.flatten() * s for a, b in weights.values()
                              for w, s in ((a, 1), (b, 2))]).to(dev)
            got = torch.cat([torch.cat((p.layer.lora.a[p.slice, last].flatten(),
                                        p.layer.lora.b[last, p.layer.slice_rows(p.slice)].flatten()))
                             for p in projections.values()])
            assert torch.equal(got, want), "slot contents differ from the adapter"
            label = "batched" if batched else "per tensor"
            row = dict(copies=label, host_ms=statistics.median(host[2:]) * 1e3,
                       gpu_ms=statistics.median(gpu[2:]), MiB=buf.nbytes / 2**20)
            results.append(row)
            print(f"{label:10s}: host {row['host_ms']:7.2f} ms, GPU {row['gpu_ms']:7.2f} ms per load "
                  f"({row['MiB']:.0f} MiB)")
    finally:
        slots_mod.BATCHED_COPIES = saved
    harness.write_json(args.out, results, args)


if __name__ == "__main__":
    main()
