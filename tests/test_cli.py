"""`loraplex` misused: one line `loraplex: error: ...` on stderr and status 2, as argparse
does for its own errors, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from loraplex.entrypoints.cli import main as cli


def _run(argv: list[str], capsys) -> tuple[int | str, list[str]]:
    """The CLI in this process (an exception would fail the test): status, stderr lines."""
    try:
        code = cli(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    return code, capsys.readouterr().err.strip().splitlines()


def _one_line_error(argv: list[str], capsys) -> str:
    code, err = _run(argv, capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("loraplex: error: "), (code, err)
    return err[0]


def test_tune_without_cuda(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = _one_line_error(["tune", "--model", "qwen3-30b-a3b", "--cache-dir", str(tmp_path)], capsys)
    assert "CUDA GPU" in line


def test_tune_without_triton(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "triton", None)  # as if not installed
    line = _one_line_error(["tune", "--model", "qwen3-30b-a3b", "--cache-dir", str(tmp_path)], capsys)
    assert "pip install 'loraplex[gpu]'" in line


def test_tune_offers_and_takes_only_moe_models(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli(["tune", "--help"])
    help_text = capsys.readouterr().out
    assert "qwen3-30b-a3b" in help_text and "llama-3.1-8b" not in help_text
    line = _one_line_error(["tune", "--model", "llama-3.1-8b", "--cache-dir", str(tmp_path)], capsys)
    assert "not a mixture-of-experts model" in line and "qwen3-30b-a3b" in line


@pytest.mark.parametrize("command", ["tune", "bench"])
def test_missing_model(command, tmp_path, capsys):
    line = _one_line_error([command, "--model", "/nonexistent", "--cache-dir", str(tmp_path)], capsys)
    assert "/nonexistent" in line and "bundled config" in line
    line = _one_line_error([command, "--model", str(tmp_path), "--cache-dir", str(tmp_path)], capsys)
    assert "no config.json" in line


def test_generate_missing_model(capsys):
    line = _one_line_error(["generate", "/nonexistent", "--prompt", "hi"], capsys)
    assert "/nonexistent" in line and "no config.json" in line


def test_generate_missing_adapter(model_dirs, tmp_path, capsys):
    code, err = _run(["generate", str(model_dirs["qwen3"]), "--prompt", "t5 t6", "--max-tokens", "2",
                      "--lora-modules", f"gone={tmp_path / 'gone'}"], capsys)
    assert code == 2 and err[-1].startswith("loraplex: error: adapter 'gone': ")  # after progress bars


@pytest.mark.parametrize("argv", [
    ["generate", "m", "--prompt", "hi", "--lora-modules", "no-path"],
    ["generate", "m", "--prompt", "hi", "--dtype", "fp64"],
    ["generate", "m", "--prompt", "hi", "--max-lora-rank", "0"],
    ["generate", "m", "--prompt", "hi", "--max-model-len", "0"],
    ["tune", "--model", "qwen3-30b-a3b", "--batch-sizes", "16", "0"],
    ["bench", "--model", "m", "--max-concurrency", "0"],
    ["bench", "--model", "m", "--num-prompts", "0"],
    ["bench", "--model", "m", "--num-adapters", "-1"],
])
def test_bad_flag_values_are_argparse_errors(argv, capsys):
    """Caught while parsing (a concurrency of 0 used to hang the bench), under the usage."""
    code, err = _run(argv, capsys)
    assert code == 2 and err[-1].startswith(f"loraplex {argv[0]}: error: argument "), err


def test_console_script_prints_one_line():
    proc = subprocess.run([sys.executable, "-m", "loraplex.entrypoints.cli", "generate", "/nonexistent",
                           "--prompt", "hi"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == ["loraplex: error: /nonexistent: not a model directory "
                                                "(no config.json)"]


def test_tune_lists_exactly_the_bundled_moe_configs():
    from importlib import resources

    from transformers import AutoConfig

    from loraplex.bench.workload import BUNDLED_CONFIGS, MOE_CONFIGS
    from loraplex.models.registry import model_config

    for name in BUNDLED_CONFIGS:
        with resources.as_file(resources.files("loraplex.bench") / "configs" / name) as d:
            moe = bool(model_config(AutoConfig.from_pretrained(d)).moe_layers)
        assert moe == (name in MOE_CONFIGS), name


def test_registry_commands_need_an_owner_and_an_existing_registry(adapter_dirs, tmp_path, capsys):
    """publish names an owner (--owner TENANT or --public) or fails in one line; list of a
    directory that holds no registry says so (it printed nothing)."""
    root, adapter = str(tmp_path / "reg"), str(adapter_dirs["qwen3"]["all7-r8"])
    for argv in (["registry", str(tmp_path / "none"), "list"],
                 ["registry", root, "publish", "a", adapter],
                 ["registry", root, "publish", "a", adapter, "--owner", "acme", "--public"]):
        assert cli(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("loraplex: error:") and "\n" not in err, err
    assert cli(["registry", root, "publish", "a", adapter, "--owner", "acme"]) == 0
    assert cli(["registry", root, "publish", "a", adapter, "--public"]) == 2
    assert "belongs to tenant 'acme'" in capsys.readouterr().err


def test_serve_on_a_taken_port_fails_before_loading_the_model(model_dirs, capsys, caplog):
    """The port is bound first: a taken one fails at once, in one line (it loaded the
    model, then failed to bind)."""
    import logging
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level(logging.INFO, logger="loraplex"):
            assert cli(["serve", str(model_dirs["qwen3"]), "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"loraplex: error: cannot listen on 127.0.0.1:{port}") and "\n" not in err
    assert not [r for r in caplog.records if "loaded" in r.getMessage()], "the model was not loaded"
