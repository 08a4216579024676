"""Engine options are declared once (EngineArgs): every one is a flag of serve, bench and
generate with its default in --help, and no command declares one itself (the floors of
the package: tests/test_project.py)."""

from __future__ import annotations

import argparse
import asyncio
import re

import pytest
from serving import parse_serve_args, serve_args

from loraplex.engine.args import ENGINE_GROUP, EngineArgs
from loraplex.entrypoints.cli import build_parser
from loraplex.entrypoints.cli import main as cli

COMMANDS = ("serve", "bench", "generate")
# What bench sets with parser.set_defaults (None: sized from the workload).
BENCH_DEFAULTS = dict(dtype="bfloat16", lora_load_workers=8, measure_moe_routing=True, max_loras=None,
                      max_lora_rank=None, max_num_seqs=None)


def _subparser(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_engine_arg_is_a_flag_with_its_default_in_help(command, capsys):
    with pytest.raises(SystemExit):
        cli([command, "--help"])
    text = capsys.readouterr().out
    assert re.search(r"\bmodel\b", text.split("options:")[0]), "the command's own model argument"
    section = text.split(f"{ENGINE_GROUP}:")[1]
    entries = {e.split()[0].rstrip(","): " ".join(e.split()) for e in re.split(r"\n  (?=--)", section)[1:]}
    for f in EngineArgs.cli_fields():
        flag = EngineArgs.flag(f)
        default = BENCH_DEFAULTS.get(f.name, f.default) if command == "bench" else f.default
        assert flag in entries, (command, flag)
        assert f"(default: {default})" in entries[flag], (command, entries[flag])
    assert len(entries) == len(EngineArgs.cli_fields())


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_commands_without_overrides_get_the_python_defaults(command):
    args = _subparser(command).parse_args(["m", "--prompt", "p"] if command == "generate" else ["m"])
    assert EngineArgs.from_cli_args(args) == EngineArgs("m")


@pytest.mark.parametrize("command", COMMANDS)
def test_commands_declare_no_engine_flag_themselves(command):
    """Every engine flag (and destination) of the command is the one add_cli_args made."""
    parser = _subparser(command)
    group = next(g for g in parser._action_groups if g.title == ENGINE_GROUP)
    assert len(group._group_actions) == len(EngineArgs.cli_fields())
    flags = {s for a in group._group_actions for s in a.option_strings}
    names = {f.name for f in EngineArgs.cli_fields()}
    for action in parser._actions:
        if action not in group._group_actions:
            assert not flags & set(action.option_strings), (command, action.option_strings)
            assert action.dest not in names, (command, action.dest)


def test_serve_takes_gpu_memory_utilization_and_enable_lora(model_dirs):
    from loraplex.server.run import build_server

    argv = serve_args(model_dirs["qwen3"], "--gpu-memory-utilization", "0.5", "--enable-lora")
    server, _ = build_server(parse_serve_args(argv))
    try:
        config = server.engine.engine.config
        assert config.cache.gpu_memory_utilization == 0.5
        assert config.lora.max_loras == 4  # --enable-lora changes nothing: adapters are on
    finally:
        asyncio.run(server.engine.shutdown(0))


@pytest.mark.parametrize("flag", [["--gpu-memory-utilization", "1.5"], ["--max-cpu-lora-memory", "0"],
                                  ["--max-num-seqs", "0"], ["--cudagraph-mode", "PIECEWISE"],
                                  ["--tensor-parallel-size", "0"]])
def test_bad_engine_flag_values_are_argparse_errors(flag, capsys):
    with pytest.raises(SystemExit) as e:
        cli(["serve", "m", *flag])
    assert e.value.code == 2 and f"argument {flag[0]}" in capsys.readouterr().err


def test_max_cpu_lora_memory_is_gib_on_the_command_line():
    args = _subparser("serve").parse_args(["m", "--max-cpu-lora-memory", "1.5"])
    assert EngineArgs.from_cli_args(args).max_cpu_lora_bytes == 3 << 29


def test_llm_refuses_an_unknown_keyword_and_names_the_valid_ones():
    from loraplex import LLM

    with pytest.raises(TypeError, match=r"\['max_lora'\].*max_loras, max_lora_rank"):
        LLM("/nonexistent", max_lora=8)
