"""The benchmark suite (benchmarks/): every script is listed here, imports on a CPU without
torch, Triton or loraplex, answers --help, imports no other script, names a figure that
benchmarks/RESULTS.md has, and is what benchmarks/gpu_session.sh runs."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
# The maintained scripts. A new script goes here, with a docstring naming its figure in
# RESULTS.md and a main(argv=None) whose parser comes from benchmarks.harness.
SCRIPTS = ("adapter_load", "attention_sweep", "base_gemms", "decode_breakdown", "kernels",
           "loader_interference", "mixed_steps", "moe_kernels", "pdl_probe", "prefill_kernels",
           "prefill_lora", "profile_decode", "profile_prefill", "replica_routing", "slot_load", "speculative",
           "structured_outputs", "train_model", "train_moe")
MODULES = ("__init__", "harness")  # not scripts
OTHER_FILES = ("LOG.md", "RESULTS.md", "gpu_session.sh")


@pytest.fixture(autouse=True)
def _repo_root_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))


def test_every_file_in_benchmarks_is_covered():
    files = {p.name for p in BENCH.iterdir() if p.is_file()}
    scripts = {p.stem for p in BENCH.glob("*.py")} - set(MODULES)
    assert scripts == set(SCRIPTS), (
        "benchmarks/ and SCRIPTS differ: a new script must be listed in SCRIPTS (and answer --help); "
        f"unlisted {sorted(scripts - set(SCRIPTS))}, missing {sorted(set(SCRIPTS) - scripts)}")
    others = files - {p.name for p in BENCH.glob("*.py")}
    assert others == set(OTHER_FILES), f"unexpected files in benchmarks/: {sorted(others - set(OTHER_FILES))}"


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_help(name, capsys):
    module = importlib.import_module(f"benchmarks.{name}")
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:"), out[:200]
    for common in ("--out", "--cache-dir"):  # the harness's common parent
        assert common in out, f"{name}: {common} missing from --help"


def test_importing_the_scripts_needs_no_gpu_stack():
    """Imports of torch, Triton and loraplex sit inside functions: a fresh interpreter that
    imports every script (and runs one --help) loads none of them."""
    code = ("import importlib, sys, contextlib, io\n"
            f"for name in {SCRIPTS!r}:\n"
            "    importlib.import_module('benchmarks.' + name)\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "    importlib.import_module('benchmarks.kernels').main(['--help'])\n"
            "print(sorted(m for m in ('torch', 'triton', 'loraplex') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("name", SCRIPTS + ("harness",))
def test_no_script_imports_another(name):
    tree = ast.parse((BENCH / f"{name}.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "benchmarks":
            assert [a.name for a in node.names] == ["harness"], ast.unparse(node)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            top = node.module.split(".")[0]
            assert top not in SCRIPTS + ("harness",), ast.unparse(node)
            assert not node.module.startswith("benchmarks."), ast.unparse(node)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                assert alias.name.split(".")[0] not in SCRIPTS + ("harness",), ast.unparse(node)
                assert not alias.name.startswith("benchmarks."), ast.unparse(node)


def _headings(markdown: str) -> set[str]:
    return {m.strip() for m in re.findall(r"^#+\s+(.*)$", markdown, re.M)}


@pytest.mark.parametrize("name", SCRIPTS)
def test_docstring_names_a_figure_in_results(name):
    doc = ast.get_docstring(ast.parse((BENCH / f"{name}.py").read_text()))
    assert doc and "RESULTS.md" in doc, f"{name}: the docstring says which figure it produces"
    figures = re.findall(r'"([^"]+)"', " ".join(doc.split("RESULTS.md", 1)[1].split()))
    assert figures, f"{name}: name the figure in quotes after RESULTS.md"
    headings = _headings((BENCH / "RESULTS.md").read_text())
    for figure in figures:
        assert figure in headings, f"{name}: RESULTS.md has no heading {figure!r}"


def test_gpu_session_runs_the_suite():
    session = (BENCH / "gpu_session.sh").read_text()
    run = set(re.findall(r"\brun [\w-]+ \d+ (\w+)", session))
    assert run == set(SCRIPTS), f"gpu_session.sh runs {sorted(run)}"
    for path in BENCH.iterdir():
        if path.is_file() and path.suffix in (".py", ".sh"):
            assert "/tmp/lp" not in path.read_text(), f"{path.name}: caches go to --cache-dir"


def test_speculative_refuses_no_waves(capsys):
    """--waves 0 would measure nothing (a median of no requests): refused at the command line."""
    from benchmarks import speculative

    with pytest.raises(SystemExit):
        speculative.main(["--waves", "0"])
    assert "--waves must be at least 1, got 0" in capsys.readouterr().err


def test_decode_breakdown_refuses_tiles_that_are_not_powers_of_two(capsys):
    """--expert-lora-gemv sets Triton tile sizes: a value that is not a power of 2 is refused
    at the command line, before an engine is built."""
    from benchmarks import decode_breakdown

    with pytest.raises(SystemExit):
        decode_breakdown.main(["--expert-lora-gemv", "4", "3000", "4096"])
    assert "--expert-lora-gemv takes powers of 2" in capsys.readouterr().err


def test_profile_decode_layer_timeline():
    """One decoder layer of the last profiled step, from its anchor kernel to the next,
    with each kernel's stream (a side stream's work shows beside the main one's)."""
    from benchmarks.profile_decode import layer_timeline

    events, t = [{"cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 1.0}], 0.0
    for _ in range(2 * 4):  # two steps of four layers
        for name, dur, stream in (("_write_kv_kernel", 1.0, 7), ("_gemm_kernel(int)", 10.0, 9),
                                  ("_shrink<bf16>", 4.0, 7)):
            events.append({"cat": "kernel", "name": name, "ts": t, "dur": dur, "args": {"stream": stream}})
            t += 2.0 if stream == 9 else dur + 0.5
    got = layer_timeline(events, "_write_kv", steps=2)
    assert [k["name"] for k in got] == ["_write_kv_kernel", "_gemm_kernel", "_shrink"]
    assert [k["stream"] for k in got] == [7, 9, 7] and [k["start_us"] for k in got] == [0.0, 1.5, 3.5]
    assert layer_timeline(events, "_absent", steps=2) == []


def test_decode_breakdown_can_time_w8a8_without_its_quantization_launches(monkeypatch):
    """--without-activation-quant: each quantization of a shape replays its first result
    (computed once, eagerly), so a graph captured after it launches none."""
    pytest.importorskip("triton")
    import torch
    from conftest import DEVICE

    from benchmarks import decode_breakdown
    from loraplex.ops.triton import fp8_activations

    attention = importlib.import_module("loraplex.ops.triton.paged_attention")
    calls = []
    real = fp8_activations.quantize_activations
    monkeypatch.setattr(fp8_activations, "quantize_activations",
                        lambda x, b: calls.append(x.shape) or real(x, b))
    monkeypatch.setattr(attention, "quantize_activations", attention.quantize_activations)  # restored after
    decode_breakdown.without_activation_quant()
    x = torch.randn(3, 256, device=DEVICE)
    first = fp8_activations.fp8_rows(x, 128, None)
    assert torch.equal(first[0].float(), real(x, 128)[0].float())
    assert attention.quantize_activations(x + 1, 128) is first and len(calls) == 1
    fp8_activations.quantize_activations(torch.randn(5, 256, device=DEVICE), 128)
    assert len(calls) == 2


def test_model_shapes_of_the_moe_configs():
    """Every bundled MoE config gives its expert shape, whatever its config calls the
    expert count (DeepSeek: n_routed_experts)."""
    harness = importlib.import_module("benchmarks.harness")
    shapes = {name: harness.model_shape(name).expert_shape()
              for name in ("qwen3-30b-a3b", "gpt-oss-20b", "deepseek-v2-lite")}
    assert shapes == {"qwen3-30b-a3b": (128, 2048, 768, 8), "gpt-oss-20b": (32, 2880, 2880, 4),
                      "deepseek-v2-lite": (64, 2048, 1408, 6)}
