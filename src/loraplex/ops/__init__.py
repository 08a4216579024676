"""The one place kernels are chosen.

Every op below is the single dispatch point for its computation. Each backend (a module
exporting functions of the same names and signatures) implements all of them:
`reference` is plain torch, runs anywhere and is the oracle of every kernel.
Layers call `loraplex.ops.<op>`; nothing else imports a backend directly.
"""

from __future__ import annotations

import functools
import importlib
from contextlib import contextmanager
from types import ModuleType

import torch
import torch.nn.functional as F

from loraplex.ops.formats import Fp8Rows, QuantizedWeight
from loraplex.ops.metadata import AttentionBatch, LoRABatch, MLALoRA, MoELoRA, QKNorm
from loraplex.ops.reference.quant import w8a8

_BACKENDS = {"torch": "loraplex.ops.reference", "triton": "loraplex.ops.triton"}
_impl: ModuleType = importlib.import_module(_BACKENDS["torch"])


def use_backend(name: str) -> None:
    """Route every op to backend `name` ("torch", or "triton" on CUDA / TRITON_INTERPRET)."""
    global _impl
    if name not in _BACKENDS:
        raise ValueError(f"unknown ops backend {name!r}; known: {', '.join(_BACKENDS)}")
    _impl = importlib.import_module(_BACKENDS[name])


@contextmanager
def using_backend(name: str):
    """Route ops to backend `name` inside the block (engines of different backends may
    share a process)."""
    global _impl
    prev = _impl
    use_backend(name)
    try:
        yield
    finally:
        _impl = prev


@functools.cache
def _module(name: str) -> ModuleType:
    return importlib.import_module(_BACKENDS[name])


def backend_for(device: torch.device | str) -> ModuleType:
    """The backend module for code outside the engine (training), per tensor device:
    Triton on CUDA, plain torch elsewhere. The engine's ops follow `use_backend` instead."""
    return _module("triton" if torch.device(device).type == "cuda" else "torch")


def backend_name() -> str:
    return next(k for k, v in _BACKENDS.items() if v == _impl.__name__)


Weight = torch.Tensor | QuantizedWeight


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None,
           x_fp8: Fp8Rows | None = None) -> torch.Tensor:
    """Semantics: x @ W.T + bias, W [N, K] a tensor or a quantized weight read as
    dequantize(W) (ops/formats): activations are not quantized, except for a W8A8
    Fp8Weight (act_block: x quantized per token first, e4m3 products summed in float32,
    ops.reference.quant.linear). x [T, K] -> [T, N]. x_fp8 (optional): x's e4m3 rows,
    quantize_activations(x, act_block), where the op that wrote x wrote them too: a
    backend may read them instead of quantizing x again. No effect on the result."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    return _impl.quant_linear(x, weight, bias, x_fp8)


def fp8_input_block(weights: list[Weight], tokens: int) -> int:
    """The act_block with which every W8A8 weight of `weights` (GEMMs reading one input)
    quantizes that input in a step of `tokens`, or 0 where any reads it unquantized or
    their blocks differ: the fp8_block for the norm that writes the input (rms_norm)."""
    blocks = {w.act_block if w8a8(w, tokens) else 0 for w in weights}
    return blocks.pop() if len(blocks) == 1 else 0


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """Semantics: the weight a quantized one stands for, [..., N, K] in weight.dtype (each
    format's formula in ops/formats)."""
    return _impl.dequantize(weight)


def quantize(weight: QuantizedWeight, values: torch.Tensor) -> None:
    """Semantics: weight := values [..., N, K] in weight's format, its scales from the
    values (per format: ops/reference/quant.py). Random weights and load-time
    quantization; plain torch on any backend."""
    _module("torch").quantize(weight, values)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
    """Semantics: out[s, t, :r] = x[t] @ lora_a[s, slot[t], :r].T for tokens t with an adapter.

    x [T, in]; lora_a [S, max_loras, R, in] (S output slices, e.g. q/k/v); returns
    out [S, T, R] float32. Rows of tokens without an adapter are left unspecified.
    """
    return _impl.lora_shrink(x, lora_a, batch)


def lora_expand(
    buf: torch.Tensor,
    lora_b: torch.Tensor,
    y: torch.Tensor,
    slice_sizes: tuple[int, ...],
    batch: LoRABatch,
) -> None:
    """Semantics: y[t, o_s:o_s+n_s] += buf[s, t, :r] @ lora_b[slot[t], o_s:o_s+n_s, :r].T.

    In place, for tokens t with an adapter. buf [S, T, R] from lora_shrink; lora_b
    [max_loras, sum(n_s), R] with the adapter's scaling folded in; y [T, sum(n_s)];
    slice s covers columns [o_s, o_s + n_s), n_s = slice_sizes[s].
    """
    _impl.lora_expand(buf, lora_b, y, slice_sizes, batch)


def lora_linear(
    x: torch.Tensor,
    weight: Weight,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slice_sizes: tuple[int, ...],
    batch: LoRABatch,
    side_stream: torch.cuda.Stream | None = None,
    x_fp8: Fp8Rows | None = None,
) -> torch.Tensor:
    """Semantics: linear(x, weight, bias) plus each token's adapter delta,
    lora_expand(lora_shrink(x, lora_a, batch), lora_b, .., slice_sizes, batch): an adapted
    projection's whole step, so a backend may fuse the delta into the base matmul.
    side_stream (CUDA, optional): a stream the shrink may run on beside the base matmul
    (it must not be in use elsewhere during the call). x_fp8: as in linear (the
    adapters read x). x [T, K] -> [T, N] in x's dtype."""
    return _impl.lora_linear(x, weight, bias, lora_a, lora_b, slice_sizes, batch, side_stream, x_fp8)


def lora_act_and_mul(
    gate_up: torch.Tensor,
    buf: torch.Tensor,
    lora_b: torch.Tensor,
    batch: LoRABatch,
    activation: str,
) -> torch.Tensor:
    """Semantics: act(g) * u, where [g | u] = gate_up + the LoRA delta, rounded to gate_up's
    dtype as lora_expand would store it (slices gate and up, I columns each), and act =
    SiLU ("silu") or tanh GELU ("gelu_tanh"): silu_and_mul after lora_expand, bit for bit.

    gate_up [T, 2I], the base gate/up projection's output, is not modified; buf [2, T, R]
    from lora_shrink; lora_b [max_loras, 2I, R]. Returns [T, I]. A gated MLP calls this
    instead of lora_expand + silu_and_mul: the delta goes into the activation's registers,
    so the projection's output is not read and written once more just to add it.
    """
    return _impl.lora_act_and_mul(gate_up, buf, lora_b, batch, activation)


def warm_up_lora(lora_a: torch.Tensor, lora_b: torch.Tensor, slice_sizes: tuple[int, ...],
                 max_tokens: int) -> None:
    """Compile now whatever lora_shrink / lora_expand will run for steps of up to
    max_tokens tokens, for these slot tensors (a backend that compiles per token count
    would otherwise stall serving when a new count arrives). No effect on any tensor."""
    warm = getattr(_impl, "warm_up_lora", None)
    if warm is not None:
        warm(lora_a, lora_b, slice_sizes, max_tokens)


def warm_up_moe(w_gate_up: torch.Tensor, w_down: torch.Tensor, top_k: int, renormalize: bool,
                activation: str, b_gate_up: torch.Tensor | None, b_down: torch.Tensor | None,
                lora: MoELoRA | None, swiglu_limit: float | None, max_tokens: int) -> None:
    """Compile now whatever route_experts / fused_experts will run for eager steps of up
    to max_tokens tokens with these weights, with and without `lora` (its token_slot is
    ignored). A backend whose kernel configs follow the token count would otherwise
    compile mid-serving (~1 s for every request in flight). No effect on any tensor."""
    warm = getattr(_impl, "warm_up_moe", None)
    if warm is not None:
        warm(w_gate_up, w_down, top_k, renormalize, activation, b_gate_up, b_down, lora,
             swiglu_limit, max_tokens)


def race_sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """Semantics: out[r] = argmax(logits[r]) if temperature[r] < 1e-5, else
    argmax(logits[r] / temperature[r] - log(E_r)) with E_r [vocab] i.i.d. Exp(1) (clamped
    to >= 1e-20), so token i is drawn with probability softmax(logits[r] / T)_i.

    logits [N, vocab] (any float dtype, not modified); temperature [N] float32; seeds [N]
    int64: E_r is a function of seeds[r] alone, so equal seeds give equal draws in any
    batch. Backends draw E differently (same distribution, not the same numbers).
    Returns token ids [N] int64.
    """
    return _impl.race_sample(logits, temperature, seeds)


def ngram_inputs(input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 seq_lens: torch.Tensor, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                 chunks: torch.Tensor, last_ids: torch.Tensor, last_shift: torch.Tensor,
                 history: torch.Tensor, block_size: int, n_min: int, n_max: int,
                 max_drafts: int) -> torch.Tensor:
    """Semantics: a step's inputs completed on the device when it was planned before the
    previous step's results (speculation planned ahead; runner/ngram_drafts.py). For
    each chunk c, chunks[c] = (src, row, k) int64:

    - src >= 0 (its first token is the one the previous step added): input_ids[first
      token] = last_ids[src]; its positions and seq_lens[c] move by last_shift[src] (the
      proposals that step did not keep, as <= 0) and its slot_mapping entries are
      recomputed from block_tables[c] (block_size tokens a page);
    - row >= 0: history[row, position] = token for each of its tokens but the last k;
    - k > 0 (a chunk that speculates; its last k tokens are placeholders): with L the
      known tokens history[row, :L] (through its last non-placeholder token), the
      latest earlier occurrence, ending at e - 1 < L - 1, of the longest suffix of
      n_min..n_max tokens; proposal = history[row, e + j % (L - e)] for j < k (past L
      the sequence repeats with period L - e), written over the placeholders and into
      history[row, L:]; none where no suffix occurred.

    In place on input_ids [T] int64, positions [T] int64, slot_mapping [T] int64,
    seq_lens [B] int32, history [R, max_len] int32; query_start_loc [B + 1] int32;
    last_ids int64, last_shift int32 (any length when no src is set); max_drafts >= every
    k. Returns found [C] int32: each chunk's proposal length (0 or k).
    """
    return _impl.ngram_inputs(input_ids, positions, slot_mapping, seq_lens, block_tables, query_start_loc,
                              chunks, last_ids, last_shift, history, block_size, n_min, n_max, max_drafts)


def greedy_accept(best: torch.Tensor, input_ids: torch.Tensor, spec: torch.Tensor,
                  found: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Semantics: greedy verification of speculated tokens. best [S, k + 1] int64: the
    target's argmax at each verified row of sequence s (row 0 its last known token);
    spec [S, 3] int64: (first, slots, c): its proposals are input_ids[first + 1 : first
    + 1 + found[c]] (found int32, indexed by chunk), out of `slots` draft positions.
    Kept: the proposals before the first one that differs from best[s, j]; then the
    extra token best[s, a] (a = the number kept). Returns verified [S, k + 3] int64 (the
    kept proposals, the extra token, -1 to column k + 1; then a; then found[c]: what the
    host reads, in one copy), added [S] int64 (the extra token: the one the next step
    is fed) and shift [S] int32 = a - slots (where the sequence's next step starts
    against a plan that kept every slot)."""
    return _impl.greedy_accept(best, input_ids, spec, found)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Semantics: k_cache.view(-1, Hkv, D)[slot_mapping[t]] = k[t] (and v likewise).

    k, v [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D]; tokens with a negative
    slot (padding) are skipped.
    """
    _impl.write_kv_cache(k, v, k_cache, v_cache, slot_mapping)


def rotate_and_store(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, qk_norm: QKNorm | None = None,
) -> torch.Tensor:
    """Semantics: q, k = rotary_embedding(q, k, positions, cos_sin, qk_norm);
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping); returns q (q, k, v themselves are
    not written). One op so that a backend may do both in one pass over k."""
    return _impl.rotate_and_store(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, qk_norm)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None = None,
    fp8_block: int = 0,
):
    """Semantics: out[t] = softmax(scale * q[t] @ K_b.T + mask) @ V_b for t in seq b.

    q [T, Hq, D] (Hq a multiple of Hkv: grouped-query attention); K_b, V_b are seq b's
    first seq_lens[b] cached keys/values, read through its block table; the new tokens
    are the last ones of the context, causal; with a sliding window, key position k is
    visible to query position p iff p - window < k <= p. sinks [Hq] (gpt-oss), read as
    float32: head h's softmax gets one more logit, sinks[h], with no value (it only adds
    exp(sinks[h]) to the denominator, so a row's weights sum to less than 1). A row with
    no visible key (padding: seq_lens[b] = 0, or less than the query) is zero.
    Returns [T, Hq, D]; with fp8_block, (out, Fp8Rows(*quantize_activations(out [T, Hq * D],
    fp8_block))): the rows a W8A8 o_proj reads (ops.linear's x_fp8).
    """
    return _impl.paged_attention(q, k_cache, v_cache, batch, scale, sliding_window, sinks, fp8_block)


def write_latent_cache(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Semantics: cache.view(-1, D)[slot_mapping[t]] = latent[t] for every t with
    slot_mapping[t] >= 0. latent [T, D] (the normed KV latent, then the rotated key),
    cache [num_blocks, block_size, D]."""
    _impl.write_latent_cache(latent, cache, slot_mapping)


def mla_attention(
    q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, w_uk: torch.Tensor,
    w_uv: torch.Tensor, batch: AttentionBatch, scale: float, lora: MLALoRA | None = None,
) -> torch.Tensor:
    """Semantics: multi-head latent attention over the cache, kv_b_proj absorbed.

    With c_j, k_j a context token's latent [r] and rotary key [d] (cache rows: c then k),
    head h of token t (adapter slot s) attends with
      q_lat = W_uk[h]^T q_nope[t, h] + A_s^T (B_k[s, h]^T q_nope[t, h])       [r]
      score_j = scale * (q_lat . c_j + q_pe[t, h] . k_j), causal as paged_attention
      o = W_uv[h] o_lat + B_v[s, h] (A_s o_lat), o_lat = sum_j softmax(score)_j c_j
    which equals expanding every c_j through kv_b_proj + its adapter (keys [W_uk; W_uv]
    rows per head) and attending over the expanded keys and values.

    q_nope [T, H, n], q_pe [T, H, d], cache [num_blocks, block_size, r + d], w_uk [H, n, r],
    w_uv [H, v, r] -> [T, H, v] in q's dtype. Rows of sequences with no context are 0.
    The Triton backend has a kernel for steps of one token per sequence (graph safe);
    longer chunks expand keys and values and attend through torch's SDPA (eager).
    """
    return _impl.mla_attention(q_nope, q_pe, cache, w_uk, w_uv, batch, scale, lora)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False,
             fp8_block: int = 0):
    """Semantics: weight * (x / sqrt(mean(x^2, -1) + eps)) over the last dim, in float32.

    x [..., N]: rows may be a strided view such as the heads of a [T, H, D] projection.
    unit_offset (Gemma): the scale is (1 + weight), applied before rounding to x's dtype;
    otherwise (Llama) the normalised row is rounded first, then scaled.
    fp8_block (a power of 2; x [T, N]): returns (y, Fp8Rows(*quantize_activations(y,
    fp8_block))), the rows a W8A8 GEMM reading y multiplies (ops.linear's x_fp8).
    """
    return _impl.rms_norm(x, weight, eps, unit_offset, fp8_block)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    unit_offset: bool = False, fp8_block: int = 0,
):
    """Semantics: r = x + residual (in x's dtype); return (rms_norm(r, ...), r), and with
    fp8_block (y, r, y's Fp8Rows) as rms_norm gives them.

    x [T, N], or [T, K, N]: each token's K rows are summed first (float32, rounded to x's
    dtype), as a MoE block's unsummed expert outputs (fused_experts, sum_topk=False) are.
    """
    return _impl.add_rms_norm(x, residual, weight, eps, unit_offset, fp8_block)


RMS_NORM_MODES = ("llama", "fp32_weight", "unit_offset")


def rms_norm_train(x: torch.Tensor, weight: torch.Tensor, eps: float, mode: str
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: (y, rstd), rstd = 1 / sqrt(mean(x^2, -1) + eps) float32 [...] and y the
    norm as transformers rounds it, xhat = x * rstd in float32 (training; train/norms.py):
      "llama" (Llama, Qwen, Mistral, Mixtral, DeepSeek): weight * xhat.to(x.dtype), in the
        promoted dtype of weight and x (rounded, then scaled);
      "fp32_weight" (gpt-oss): (weight * xhat).to(x.dtype) (scaled in float32, rounded);
      "unit_offset" (Gemma): (xhat * (1 + weight.float())).to(x.dtype).
    x [..., N] with a unit stride last: any leading shape and strides (a q/k norm's
    heads). The backend follows x's device (`backend_for`): Triton on CUDA.
    """
    if mode not in RMS_NORM_MODES:
        raise ValueError(f"unknown RMSNorm mode {mode!r}; known: {', '.join(RMS_NORM_MODES)}")
    return backend_for(x.device).rms_norm_train(x, weight, eps, mode)


def rms_norm_backward(g: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor,
                      mode: str) -> torch.Tensor:
    """Semantics: dx of rms_norm_train for a frozen weight (no weight gradient), in x's
    dtype: dx = rstd * (gx - xhat * mean(gx * xhat, -1)), xhat = x * rstd, gx = g * weight
    ("unit_offset": g * (1 + weight)), in float32; the forward's rounding passes the
    gradient through as it is. g [..., N] as y, rstd as rms_norm_train returned it."""
    return backend_for(x.device).rms_norm_backward(g, x, rstd, weight, mode)


def rope_train(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Semantics: x * cos + rotate_half(x) * sin (NeoX half split: rotate_half(x) =
    cat(-x2, x1)) in float32, rounded once to x's dtype (training; train/rope.py).
    x [B, H, S, D] of any strides with a unit last one (y has x's layout); cos, sin
    [B or 1, S, D] as transformers' rotary embeddings make them. Follows x's device."""
    return backend_for(x.device).rope_train(x, cos, sin)


def rope_train_backward(g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Semantics: dx of rope_train for the output gradient g: g * cos + r(g * sin), r the
    transpose of rotate_half (r(v) = cat(v2, -v1)), in float32, rounded once."""
    return backend_for(g.device).rope_train_backward(g, cos, sin)


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
    qk_norm: QKNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: x -> x * cos(p f) + rotate_half(x) * sin(p f) for q and k (NeoX style).

    q [T, Hq, D], k [T, Hkv, D], positions [T]; cos_sin [max_pos, D] = cat(cos, sin) of
    position x inverse frequency, float32. With qk_norm (Qwen3, Gemma 3), each head's
    vector is first rms_norm'ed with q_weight / k_weight, in the same launch.
    """
    return _impl.rotary_embedding(q, k, positions, cos_sin, qk_norm)


def route_experts(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: p = softmax(logits) in float32; the top_k experts per token and their p,
    divided by their sum if renormalize. logits [T, E] -> (weights float32 [T, k],
    expert ids int32 [T, k])."""
    return _impl.route_experts(logits, top_k, renormalize)


def route_tokens(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None, top_k: int,
                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: route_experts(linear(x, weight, bias), top_k, renormalize): the router's
    logits (in x's dtype, as linear returns them) and their routing, in one op so that a
    backend may fuse the two (decode steps). x [T, H], weight [E, H] -> (weights float32
    [T, k], expert ids int32 [T, k])."""
    if not isinstance(weight, torch.Tensor):  # a quantized router: its GEMM, then the routing
        return route_experts(linear(x, weight, bias), top_k, renormalize)
    return _impl.route_tokens(x, weight, bias, top_k, renormalize)


def route_experts_grouped(
    logits: torch.Tensor, top_k: int, method: str, num_groups: int, topk_group: int, renormalize: bool,
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: DeepSeek's grouped routing (config.ROUTINGS), experts in num_groups
    equal groups. group_limited_greedy: p = softmax(logits); keep the topk_group groups of
    the highest max p, top_k of p among their experts, weights p. noaux_tc: p =
    sigmoid(logits); choose with p + correction_bias: the groups of the highest sum of
    their two best, top_k among those; weights p at the chosen. renormalize: weights / their
    sum (+ 1e-20). logits [T, E] -> (weights [T, top_k] float32, ids [T, top_k] int64)."""
    return _impl.route_experts_grouped(logits, top_k, method, num_groups, topk_group, renormalize,
                                       correction_bias)


def fused_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w_gate_up: Weight,
    w_down: Weight,
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
    """Semantics: out[t] = sum_j w[t, j] * down_e(act(gate_up_e(x[t]))), e = ids[t, j].

    x [T, H]; w_gate_up [E, 2I, H] (gate rows, then up rows; a tensor or a quantized
    weight, read as dequantize(w); W8A8 Fp8Weights quantize each GEMM's input, x and
    the activation's output, as ops.linear does), b_gate_up [E, 2I];
    w_down [E, H, I], b_down [E, H]; activation "silu", "gelu_tanh" (act(g) * u) or
    "swiglu_oai" (gpt-oss: clamped at swiglu_limit, g * sigmoid(1.702 g) * (u + 1)).
    With `lora`, a token in slot s adds (x A_se^T) B_se^T to gate_up_e's output
    (before the activation) and (h A'_se^T) B'_se^T to down_e's (before the weight).
    routing_stats, float32 [2] (measuring only): (distinct experts in topk_ids, 1) is
    added to it, on the device, without a launch of its own where the backend can.
    side_stream (CUDA, optional): a stream the backend may run work on beside the current
    one (the adapter deltas beside the expert alignment and the down GEMM); it must not
    be in use elsewhere during the call. No effect on any result. x_fp8: x's e4m3 rows
    for W8A8 gate/up experts, as in linear (no effect on the result).
    Returns [T, H] in x's dtype; sum_topk=False: [T, K, H], the terms of the sum (each
    rounded to x's dtype), for a later op to add (add_rms_norm does): K = top_k, or
    more where a backend gives terms of its own (the Triton one's down deltas in
    decode-sized steps with adapters: 2 top_k).
    """
    return _impl.fused_experts(x, topk_weights, topk_ids, w_gate_up, w_down, activation,
                               b_gate_up, b_down, lora, swiglu_limit, routing_stats, side_stream,
                               sum_topk, x_fp8)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Semantics: silu(x[:, :I]) * x[:, I:] for x [T, 2I]."""
    return _impl.silu_and_mul(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Semantics: gelu_tanh(x[:, :I]) * x[:, I:] for x [T, 2I] (PyTorch's tanh GELU)."""
    return _impl.gelu_tanh_and_mul(x)


__all__ = [
    "AttentionBatch",
    "QuantizedWeight",
    "add_rms_norm",
    "dequantize",
    "fused_experts",
    "greedy_accept",
    "linear",
    "ngram_inputs",
    "quantize",
    "MoELoRA",
    "route_experts",
    "route_tokens",
    "rotate_and_store",
    "LoRABatch",
    "backend_name",
    "gelu_tanh_and_mul",
    "lora_act_and_mul",
    "lora_expand",
    "lora_shrink",
    "paged_attention",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_train",
    "rotary_embedding",
    "silu_and_mul",
    "use_backend",
    "using_backend",
    "warm_up_lora",
    "warm_up_moe",
    "write_kv_cache",
]
