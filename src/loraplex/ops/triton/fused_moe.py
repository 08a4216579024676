"""The MoE MLP from the grouped GEMM kernels: align pairs by expert, gate/up GEMM, down
GEMM, weighted sum over each token's top_k outputs.

The activation runs in the gate/up GEMM's epilogue and the routing weight in the down
GEMM's. With adapters (MoELoRA) each delta must land before those, so it is computed
first and the GEMM's epilogue adds it to its float32 accumulator: the same launches as
the base path plus one adapter kernel per projection, and base + delta rounded once.
(W8A8 experts in decode-sized steps: the gate/up delta's kernel runs beside the gate/up
GEMM, which writes float32 sums; moe_act.gated_act_rows adds the delta and applies the
activation after both, rounding once as well: gate_up_delta_beside.)
Decode-sized steps (up to GEMV_MAX_TOKENS tokens, where nearly every (slot, expert)
group holds one pair) compute each pair's delta on its own (moe_lora_gemv.py), every
pair's row written (zeros where no adapter) so that the GEMM's epilogue loads it with
no slot -> mask -> row chain and before its main loop (moe_epilogue.py); larger ones
sort the pairs by (slot, expert) first and run tensor-core tiles (moe_lora.py).
Where the experts take the GEMV form too, the adapter kernel stops at each pair's
shrunk [R] row and the GEMV's programs expand it at their own columns: two short
kernels in front of the GEMVs instead of two that also stream every B. (The grouped
GEMMs expanding shrunk rows too, one tl.dot per adapter slot in a tile, ran 2-4x slower
on an H200: benchmarks/LOG.md, "The grouped GEMMs' slot expand, timed".)
Deltas are float32: adapters of the size of the base output, rounded to bf16 on their
own, added ~40% to the error. The down projection's delta needs nothing after it but
the top-k sum: in decode-sized steps its kernel writes each pair's delta, times the
routing weight, as one more term of the sum (bf16 rows interleaved with the GEMM's:
[T, top_k, 2, H]), so the down GEMM and its adapter kernel run side by side (on the side
stream where one is given) rather than one after the other.
Quantized experts (Mxfp4Weight, Fp8Weight) are read as they are stored in steps of
fewer pairs per expert than moe_configs.DEQUANTIZE_MIN_PAIRS_PER_EXPERT: the grouped
GEMM's quantized variant (moe_gemm_quant.py), or, for steps of no more pairs than
experts (decode), one program per pair and column block (moe_gemv_quant.py), which needs
no expert alignment. Larger steps (prefill) dequantize each stack into a scratch tensor
just before its GEMM and run the bf16 grouped GEMM on it (one stack at a time:
gpt-oss-20b's gate/up is 1 GB). W8A8 experts (Fp8Weight with act_block) take the
grouped GEMM in every step where they quantize their activations
(all, or from act_min_tokens on: `--fp8-activations prefill`), each GEMM's input (x,
then h) quantized to e4m3 rows first (fp8_activations.py; x's come from the norm that
wrote x where the model passes them: x_fp8); the adapters read them unquantized.
Smaller steps read them as weight-only experts.
The expert LoRA kernels are the same for every weight format. (Int4Weight experts, which no kernel reads yet,
are dequantized on each call.)
Every launch reads only device tensors and its grid depends on shapes only (no host
sync: captured and replayed in a CUDA graph on an H100, matching eager bit for bit).
"""

from __future__ import annotations

import torch

from loraplex.ops.formats import Fp8Rows, QuantizedWeight
from loraplex.ops.metadata import MoELoRA
from loraplex.ops.reference.quant import dequantize, w8a8
from loraplex.ops.side_streams import beside, join
from loraplex.ops.triton.dequantize import dequantize as dequantize_kernel
from loraplex.ops.triton.fp8_activations import fp8_rows
from loraplex.ops.triton.lora_common import GEMV_MAX_TOKENS
from loraplex.ops.triton.moe_act import check_activation, gated_act_rows
from loraplex.ops.triton.moe_align import align_experts, align_lora
from loraplex.ops.triton.moe_configs import dequantized
from loraplex.ops.triton.moe_gemm import gemm_config, moe_gemm
from loraplex.ops.triton.moe_gemm_quant import moe_gemm_quant
from loraplex.ops.triton.moe_gemv_quant import moe_gemv_quant
from loraplex.ops.triton.moe_lora import lora_block_m, moe_lora
from loraplex.ops.triton.moe_lora_gemv import moe_lora_gemv, splits_per_pair
from loraplex.ops.triton.quant_tiles import KERNEL_FORMATS

# Quantized experts take the GEMV form while a step's pairs are at most this many per
# expert (a GEMV program rereads its expert's weights for each pair, from L2 after the
# first).
GEMV_PAIRS_PER_EXPERT = 1
# In the GEMV form each program expands its pair's adapter delta at its own columns
# (moe_gemv_quant.py), so the expert-LoRA kernel in front of each GEMV runs the shrink
# alone. (A switch for benchmarks: False computes whole deltas first, as the GEMM form.)
GEMV_EXPANDS_LORA = True
# Decode-sized steps give the down delta as terms of the top-k sum, its kernel beside the
# down GEMM. (A switch for benchmarks: False adds it in the GEMM's epilogue.)
DOWN_DELTA_AS_TERMS = True
# Decode-sized steps with adapters on W8A8 experts run the gate/up delta's kernel beside
# the gate/up GEMM rather than before it (fused_experts; gate_up_delta_beside). (A switch
# for benchmarks: False has the GEMM's epilogue add the delta, as for other formats.)
GATE_UP_DELTA_BESIDE_GEMM = True
# The GEMV-form deltas are written for every pair (zeros where no adapter), so the GEMMs
# read each pair's row without loading its slot and the slot's mask first. (A switch for
# benchmarks: False writes covered pairs' rows only, as the aligned form does.)
GEMV_DELTAS_EVERY_ROW = True


def lora_form(num_tokens: int, top_k: int, device: torch.device) -> tuple[str, int]:
    """The expert-LoRA kernel variant a step of num_tokens runs: ("gemv", programs per
    pair) or ("aligned", BLOCK_M of the (slot, expert) alignment)."""
    if num_tokens <= GEMV_MAX_TOKENS:
        return "gemv", splits_per_pair(num_tokens * top_k, device)
    return "aligned", lora_block_m(num_tokens * top_k)


def gate_up_delta_beside(w_gate_up, num_tokens: int) -> bool:
    """Whether a decode-sized step with adapters (every pair's delta row written, the
    grouped GEMM) runs the gate/up delta's kernel beside the gate/up GEMM, which then
    writes float32 sums that gated_act_rows finishes; else the delta comes first and the
    GEMM's epilogue adds it. Beside only for W8A8 experts, whose e4m3 MMA GEMM leaves the
    SMs room: Qwen3-30B-A3B W8A8 with 16 adapters, decode graph 8.83 -> 8.70 ms on an
    H200. gpt-oss-20b's MXFP4 GEMM decodes its weights in registers, bound by issue,
    and the delta kernel's programs beside it slowed both (5.89 -> 6.27 ms;
    benchmarks/LOG.md, "The gate/up delta beside the gate/up GEMM")."""
    return GATE_UP_DELTA_BESIDE_GEMM and w8a8(w_gate_up, num_tokens)


def base_form(num_tokens: int, top_k: int, w_gate_up, w_down) -> str:
    """The base expert kernels a step of num_tokens runs: "gemv" (quantized experts, no
    more pairs than experts: moe_gemv_quant.py) or "gemm" (the grouped GEMM over aligned
    pair blocks: moe_gemm.py, moe_gemm_quant.py)."""
    quantized = isinstance(w_gate_up, KERNEL_FORMATS) and isinstance(w_down, KERNEL_FORMATS)
    # W8A8 experts multiply e4m3 by e4m3 on tensor cores at any size (the GEMV form's
    # gain is that it skips converting W; theirs needs no conversion).
    gemv = (quantized and not w8a8(w_gate_up, num_tokens) and not w8a8(w_down, num_tokens)
            and num_tokens * top_k <= GEMV_PAIRS_PER_EXPERT * w_gate_up.shape[0])
    return "gemv" if gemv else "gemm"


def _expert_gemm(a, w, bias, out, align, cfg, row_div, topk_ids, lora_b=None, a_fp8=None, **epilogue) -> None:
    """One of fused_experts' two GEMMs, for w's format; align None: the GEMV form (lora_b:
    the delta given as shrunk rows, which the GEMV expands). W8A8 weights, in steps where
    they quantize their activations, quantize `a` first (its rows, once for all their
    pairs), unless the op that wrote `a` gave its rows (a_fp8); quantized weights in
    steps that read them dequantized are written out first (cfg is then a bf16 config:
    moe_configs.weight_format)."""
    if align is None:
        moe_gemv_quant(a, w, bias, out, topk_ids, row_div, lora_b=lora_b, **epilogue)
    elif dequantized(w, *topk_ids.shape):
        moe_gemm(a, dequantize_kernel(w), bias, out, align, cfg, row_div, **epilogue)
    elif w8a8(w, topk_ids.shape[0]):
        a_q, a_scale = fp8_rows(a, w.act_block, a_fp8)
        moe_gemm_quant(a_q, w, bias, out, align, cfg, row_div, a_scale=a_scale, **epilogue)
    else:
        gemm = moe_gemm_quant if isinstance(w, QuantizedWeight) else moe_gemm
        gemm(a, w, bias, out, align, cfg, row_div, **epilogue)


def fused_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    activation: str = "silu",
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    lora: MoELoRA | None = None,
    swiglu_limit: float | None = None,
    routing_stats: torch.Tensor | None = None,
    side_stream: torch.cuda.Stream | None = None,
    sum_topk: bool = True,
    x_fp8: Fp8Rows | None = None,
) -> torch.Tensor:
    """See loraplex.ops.fused_experts."""
    w_gate_up, w_down = (dequantize(w) if isinstance(w, QuantizedWeight) and not isinstance(w, KERNEL_FORMATS)
                         else w for w in (w_gate_up, w_down))
    limit = check_activation(activation, swiglu_limit)
    t, top_k = topk_ids.shape
    num_experts, two_i, hidden = w_gate_up.shape
    assert x.shape == (t, hidden) and w_down.shape == (num_experts, hidden, two_i // 2)
    if t == 0:
        return x.new_empty(0, hidden) if sum_topk else x.new_empty(0, top_k, hidden)
    p, dev = t * top_k, x.device
    gemv = base_form(t, top_k, w_gate_up, w_down) == "gemv"
    cfg_gu, cfg_d = gemm_config(w_gate_up, t, top_k), gemm_config(w_down, t, top_k)
    weights = topk_weights.float().contiguous()

    def align_base(block_m, stats):
        if not gemv:
            return align_experts(topk_ids, num_experts, block_m, stats)
        if stats is not None:  # the GEMV form reads topk_ids as they are: aligned only to
            align_experts(topk_ids, num_experts, block_m, stats)  # count the experts hit
        return None

    align_l = delta_gu = delta_d = None
    gemv_expands = False  # the deltas are shrunk rows [P, R] the GEMV expands (GEMV_EXPANDS_LORA)
    delta_rows = lora  # which pairs' delta rows are written: those of tokens with an adapter
    if lora is not None:
        form, block_m = lora_form(t, top_k, dev)
        gemv_expands = gemv and form == "gemv" and GEMV_EXPANDS_LORA
        if form == "gemv" and not gemv_expands and GEMV_DELTAS_EVERY_ROW:
            delta_rows = None  # every pair's (zeros where no adapter)
        # B [L, E, N, R]: a delta row is N wide, or R where the GEMV expands it.
        delta_dim = 3 if gemv_expands else 2

        def adapter_delta(inp, a, b, row_div, which, delta, weights=None):
            ranks = lora.ranks[which] if lora.ranks is not None else None
            if align_l is None:
                b = None if gemv_expands else b  # the shrink alone
                moe_lora_gemv(inp, topk_ids, lora.token_slot, lora.slot_mask, ranks, a, b, delta, row_div,
                              weights, all_rows=delta_rows is None)
            else:
                moe_lora(inp, a, b, delta, align_l, row_div, ranks)

        def gate_up_delta():
            nonlocal align_l
            if form != "gemv":
                align_l = align_lora(topk_ids, lora.token_slot, num_experts, lora.a_gate_up.shape[0],
                                     block_m, lora.slot_mask)
            adapter_delta(x, lora.a_gate_up, lora.b_gate_up, top_k, 0, delta_gu)

        # Deltas are allocated on the current stream, so the allocator orders their reuse there.
        delta_gu = torch.empty(p, lora.b_gate_up.shape[delta_dim], dtype=torch.float32, device=dev)
    # The gate/up delta beside the GEMM (gate_up_delta_beside): the GEMM writes its float32
    # sums, gated_act_rows adds the delta and applies the activation.
    delta_after = lora is not None and delta_rows is None and not gemv and gate_up_delta_beside(w_gate_up, t)
    if lora is not None:  # the gate/up delta reads only x and the routing: beside the alignment
        with beside(side_stream):
            gate_up_delta()
    align_gu = align_base(cfg_gu["BLOCK_M"], routing_stats)
    if lora is not None and not delta_after:
        join(side_stream)
    align_d = (align_gu if gemv or cfg_d["BLOCK_M"] == cfg_gu["BLOCK_M"]
               else align_experts(topk_ids, num_experts, cfg_d["BLOCK_M"]))

    h = torch.empty(p, two_i // 2, dtype=x.dtype, device=dev)
    if delta_after:
        sums = torch.empty(p, two_i, dtype=torch.float32, device=dev)
        _expert_gemm(x, w_gate_up, b_gate_up, sums, align_gu, cfg_gu, top_k, topk_ids, a_fp8=x_fp8)
        join(side_stream)
        gated_act_rows(sums, delta_gu, h, activation, limit)
    else:
        _expert_gemm(x, w_gate_up, b_gate_up, h, align_gu, cfg_gu, top_k, topk_ids, activation=activation,
                     limit=limit, delta=delta_gu, lora=delta_rows, top_k=top_k,
                     lora_b=lora.b_gate_up if gemv_expands else None, a_fp8=x_fp8)
    # Decode-sized steps: the down delta rows, weighted, are terms of the sum: y [T, top_k,
    # 2, H] holds each pair's GEMM row, then its delta row.
    delta_terms = DOWN_DELTA_AS_TERMS and lora is not None and form == "gemv" and not gemv_expands
    y = torch.empty(t, top_k, 1 + delta_terms, hidden, dtype=x.dtype, device=dev)
    y_gemm = y.view(p, -1, hidden)[:, 0]
    if delta_terms:
        delta_d = y.view(p, 2, hidden)[:, 1]
        with beside(side_stream):
            adapter_delta(h, lora.a_down, lora.b_down, 1, 1, delta_d, weights.view(-1))
    elif lora is not None:
        delta_d = torch.empty(p, lora.b_down.shape[delta_dim], dtype=torch.float32, device=dev)
        adapter_delta(h, lora.a_down, lora.b_down, 1, 1, delta_d)
    _expert_gemm(h, w_down, b_down, y_gemm, align_d, cfg_d, 1, topk_ids, routed_weights=weights,
                 delta=None if delta_terms else delta_d, lora=delta_rows, top_k=top_k,
                 lora_b=lora.b_down if gemv_expands else None)
    if delta_terms:
        join(side_stream)
    y = y.view(t, -1, hidden)  # [T, top_k (x 2), H]
    return y.sum(1) if sum_topk else y


def warm_up_token_counts(w_gate_up: torch.Tensor, w_down: torch.Tensor, top_k: int,
                         max_tokens: int) -> list[int]:
    """Token counts whose batches, between them, run every kernel variant fused_experts
    can pick for 1..max_tokens tokens: per distinct choice of base form, GEMM configs
    (tuned or default, both follow the token count) and expert-LoRA tile, its smallest
    and largest count and its first multiple of 16 (Triton also specializes on an
    integer's divisibility by 16)."""
    ranges: dict[tuple, list[int]] = {}
    for t in range(1, max_tokens + 1):
        form = base_form(t, top_k, w_gate_up, w_down)
        configs = None if form == "gemv" else (tuple(gemm_config(w_gate_up, t, top_k).items()),
                                                tuple(gemm_config(w_down, t, top_k).items()))
        key = (form, configs, w8a8(w_gate_up, t), w8a8(w_down, t), dequantized(w_gate_up, t, top_k),
               lora_form(t, top_k, w_gate_up.device))
        ranges.setdefault(key, []).append(t)
    counts = set()
    for ts in ranges.values():
        counts |= {ts[0], ts[-1], next((t for t in ts if t % 16 == 0), ts[0])}
    return sorted(counts)


def warm_up_moe(w_gate_up, w_down, top_k, renormalize, activation, b_gate_up, b_down, lora,
                swiglu_limit, max_tokens) -> None:
    """See loraplex.ops.warm_up_moe."""
    from loraplex.ops.triton.moe_route import route_experts

    num_experts, _, hidden = w_gate_up.shape
    dev, dtype = w_gate_up.device, w_gate_up.dtype
    for t in warm_up_token_counts(w_gate_up, w_down, top_k, max_tokens):
        x = torch.zeros(t, hidden, dtype=dtype, device=dev)
        weights, _ = route_experts(torch.zeros(t, num_experts, dtype=dtype, device=dev), top_k,
                                   renormalize)
        # Pairs spread over every expert, as in a real batch.
        ids = (torch.arange(t * top_k, device=dev, dtype=torch.int32) % num_experts).view(t, top_k)
        variants = [None]
        if lora is not None:
            variants.append(MoELoRA(lora.a_gate_up, lora.b_gate_up, lora.a_down, lora.b_down,
                                    torch.zeros(t, dtype=torch.int32, device=dev),
                                    lora.slot_mask, lora.ranks))
        for v in variants:
            fused_experts(x, weights, ids, w_gate_up, w_down, activation, b_gate_up, b_down, v,
                          swiglu_limit)
