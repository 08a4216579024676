"""The hot kernels' generated code moves whole vectors (see sm90_codegen.py for why).

Compiles for sm_90 on any machine: Triton ships the NVIDIA compiler, no GPU needed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


def _compiled(*args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    script = Path(__file__).with_name("sm90_codegen.py")
    done = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def counts() -> dict:
    return _compiled()


H100_SHARED_BYTES = 232_448  # per program (227 KiB), H100 and H200


def test_attention_tiles_fit_in_shared_memory():
    """Every (dtype, head_dim) regime of paged attention compiles to tiles an H100/H200
    can hold. (float32 at head_dim 256, Gemma 3's shape, once needed 295,424 bytes: on a
    GPU that fails only at the first launch.)"""
    shared = _compiled("shared")
    assert len(shared) == 15
    assert all(0 < b <= H100_SHARED_BYTES for b in shared.values()), shared


@pytest.mark.parametrize("kernel", ["lora_expand_gemv", "lora_expand_sgmv", "lora_act_gemv", "lora_act_sgmv",
                                    "moe_gemm_gate_up", "moe_gemm_down"])
def test_bf16_outputs_are_not_read_or_written_one_element_at_a_time(counts, kernel):
    c = counts[kernel]
    assert c.get("ld.b16", 0) == 0 and c.get("st.b16", 0) == 0, c


@pytest.mark.parametrize("kernel", ["moe_lora_gemv", "moe_lora_gemv_terms"])
def test_decode_expert_adapters_read_a_and_b_in_vectors(counts, kernel):
    # A rows (contiguous along K) and B rows (rank-wide, masked at the rank rounded to 8),
    # copied to shared memory by the pipelined loops; also where every pair's row is
    # written (zeros without an adapter) as a weighted bf16 term of the top-k sum.
    c = counts[kernel]
    assert c.get("cp.async.16", 0) >= 2 and c.get("ld.b16", 0) == 0, c


@pytest.mark.parametrize("kernel", ["lora_expand_sgmv", "moe_gemm_gate_up", "moe_gemm_down", "moe_lora"])
def test_output_tiles_are_stored_in_16_byte_vectors(counts, kernel):
    c = counts[kernel]
    assert c.get("st.v4.b32", 0) > 0 and c.get("st.b32", 0) == 0, c


@pytest.mark.parametrize("kernel", ["moe_gemm_gate_up", "moe_gemm_down"])
def test_expert_gemm_reads_adapter_deltas_in_vectors(counts, kernel):
    # The float32 delta tile (and its up half, N columns on) is the epilogue's only load.
    assert counts[kernel].get("ld.v4.b32", 0) > 0, counts[kernel]


@pytest.mark.parametrize("kernel", ["rms_norm_fp8", "decode_merge_fp8"])
def test_e4m3_rows_are_written_in_vectors(counts, kernel):
    """The kernels in front of a W8A8 GEMM (the norm: 16 values a thread; the attention
    merge at one warp a head: 4) store their bf16 and e4m3 rows whole, never byte by byte."""
    c = counts[kernel]
    narrow = {k: v for k, v in c.items() if re.fullmatch(r"st\.(v[248]\.)?b(8|16)", k)}
    assert not narrow and any(k.startswith("st.v") for k in c), c


def test_sampler_reads_the_logits_in_16_byte_vectors(counts):
    """The fused sampler is one pass over [rows, vocab] float32: the logits must come in
    whole vectors (the two scalar loads are the row's temperature and seed)."""
    c = counts["race_sample"]
    assert c.get("ld.v4.b32", 0) > 0 and c.get("ld.b32", 0) <= 1, c


def test_every_kernel_waits_for_its_inputs_first(counts):
    """Launched with programmatic dependent launch (ops/triton/launch.py), each kernel's
    code waits for the grids before it once, and lets the next launch once."""
    assert counts
    for name, c in counts.items():
        assert c.get("griddepcontrol.wait") == 1 and c.get("griddepcontrol.launch_dependents") == 1, (name, c)
