"""Every Triton kernel of the engine takes part in programmatic dependent launch
(ops/triton/launch.py): it waits for its inputs before anything else, and every launch
passes launch.pdl(). A kernel launched with PDL that read an input before waiting could
read it before the kernel that writes it has finished; this keeps new kernels in line."""

from __future__ import annotations

import ast
from pathlib import Path

from loraplex.ops.triton import launch

KERNELS = Path(launch.__file__).parent


def _launches(tree: ast.AST):
    """(kernel name, call) of each `name[grid](...)` launch in a module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
            target = node.func.value
            if isinstance(target, ast.Name):
                yield target.id, node


def _first_statement(fn: ast.FunctionDef) -> ast.stmt:
    body = fn.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return body[0]


def test_every_launched_kernel_waits_first_and_every_launch_passes_pdl():
    launches = kernels = 0
    for path in sorted(KERNELS.glob("*.py")):
        if path.name == "launch.py":
            continue
        tree = ast.parse(path.read_text())
        functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        for name, call in _launches(tree):
            passes = [k for k in call.keywords if k.arg is None and ast.unparse(k.value) == "pdl()"]
            assert passes, f"{path.name}: {name}[...] launched without **pdl()"
            # A kernel passed in under another name (mla_lora's _launch) has its PDL parameter checked below.
            assert name not in functions or functions[name].args.args[-1].arg == "PDL", (path.name, name)
            launches += 1
        for fn in functions.values():
            if any(a.arg == "PDL" for a in fn.args.args):
                first = ast.unparse(_first_statement(fn))
                assert first == "wait_for_inputs(PDL)", f"{path.name}: {fn.name} starts with {first}"
                kernels += 1
    assert launches >= 40 and kernels >= 40, (launches, kernels)


def test_pdl_is_on_exactly_where_it_can_run():
    """Off under the interpreter (the CPU suite) and before sm_90; on for a GPU run on
    an H100 / H200, unless LORAPLEX_PDL=0."""
    import os

    import torch

    from loraplex.ops.triton.precision import INTERPRETED

    can = (not INTERPRETED and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
           and os.environ.get("LORAPLEX_PDL", "1") != "0")
    assert launch.pdl() == {"PDL": can, "launch_pdl": can}


def test_a_setting_other_than_0_or_1_is_refused(monkeypatch):
    """LORAPLEX_PDL=off would otherwise leave PDL on without a word: the module refuses it
    as the engine imports its kernels."""
    import importlib

    import pytest

    monkeypatch.setenv("LORAPLEX_PDL", "off")
    with pytest.raises(ValueError, match="LORAPLEX_PDL must be 0 or 1, got 'off'"):
        importlib.reload(launch)
    monkeypatch.undo()
    importlib.reload(launch)  # the module as it was, for the tests after this one


def test_kernels_on_a_side_stream_launch_without_pdl(monkeypatch):
    """Side work (LoRA shrinks, the MoE gate/up delta, DeepSeek's shared experts) launches
    in stream order (ops/side_streams.py); the main stream's keeps PDL, before and after."""
    from loraplex.ops.side_streams import on_side_stream

    monkeypatch.setattr(launch, "_enabled", lambda: True)
    assert launch.pdl() == {"PDL": True, "launch_pdl": True}
    with on_side_stream(None):
        assert launch.pdl() == {"PDL": False, "launch_pdl": False}
    assert launch.pdl() == {"PDL": True, "launch_pdl": True}


def test_work_beside_no_side_stream_stays_main_stream_work(monkeypatch):
    """beside(None) (no side stream: CPU, eager steps) launches in line on the current
    stream, with PDL as the main stream's; join(None) waits on nothing."""
    from loraplex.ops.side_streams import beside, join

    monkeypatch.setattr(launch, "_enabled", lambda: True)
    with beside(None):
        assert launch.pdl() == {"PDL": True, "launch_pdl": True}
    join(None)


def test_the_engine_enters_side_streams_only_through_on_side_stream():
    """A plain `torch.cuda.stream(...)` in the ops, layers or models would launch side work
    with PDL on."""
    src = KERNELS.parent.parent
    for folder in ("ops", "layers", "models"):
        for path in sorted((src / folder).rglob("*.py")):
            if path.name != "side_streams.py":
                assert "torch.cuda.stream(" not in path.read_text(), path
