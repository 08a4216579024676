"""The project's own front door and shape: the README's examples, the Makefile's commands,
and the floors of the package (docs/architecture.md's table)."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _curl_bodies() -> list[dict]:
    """The JSON bodies of the README's curl commands (-d '...')."""
    return [json.loads(m) for m in re.findall(r"curl [^`]*?-d \\?\s*'(\{.*?\})'", README, re.S)]


def test_readme_requests_bound_their_output():
    """Each example request says how long and how random its answer is: with OpenAI's
    defaults (no max_tokens, temperature 1) the README's first example printed 1,108
    tokens of random text over two minutes."""
    bodies = _curl_bodies()
    assert len(bodies) >= 2
    for body in bodies:
        assert "max_tokens" in body and body.get("temperature") == 0, body
    assert "temperature` 1" in README and "max_tokens`" in README, "the defaults are stated"


def test_readme_states_what_is_supported():
    assert "gpt-oss" in README.split("## Two commands")[0]
    for stale in ("not there yet", "adapters on their attention;"):
        assert stale not in README, stale


def test_make_serve_installs_once(tmp_path):
    """With the environment built, `make serve` starts the server without running pip
    (it re-ran pip, ~10 s, on every start)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for stamp in (".installed", ".installed-serve"):
        (venv / stamp).touch()
        past = time.time() + 10  # newer than pyproject.toml
        os.utime(venv / stamp, (past, past))
    out = subprocess.run(["make", "-n", "serve", f"VENV={venv}"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert "loraplex serve" in out and "pip install" not in out, out
    os.utime(venv / ".installed-serve", (0, 0))  # older than pyproject.toml: install again
    out = subprocess.run(["make", "-n", "serve", f"VENV={venv}"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert "pip install" in out


# docs/architecture.md's packages, top floor first: a module imports only from floors
# below its own (or its own package).
FLOORS = [("entrypoints",), ("deploy",), ("server", "bench"), ("engine",), ("runner",), ("models",),
          ("adapters",), ("layers", "train"), ("ops",), ("config", "types"), ("errors", "device")]
SRC = ROOT / "src" / "loraplex"


def test_every_import_runs_down_the_floors():
    """No import runs back up a floor (server built its engine through entrypoints/llm.py,
    ops imported bench, bench imported entrypoints: each is an error here). The package's
    __init__ re-exports the public API and is exempt; importing a name from it counts as
    importing that name's package."""
    floor = {name: i for i, names in enumerate(FLOORS) for name in names}
    # `from loraplex import X` imports X's package: the __init__ says which.
    public = {alias.asname or alias.name: node.module.split(".")[1]
              for node in ast.walk(ast.parse((SRC / "__init__.py").read_text()))
              if isinstance(node, ast.ImportFrom) and node.module for alias in node.names}
    offenders = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC)
        if rel == Path("__init__.py"):
            continue
        own = rel.parts[0].removesuffix(".py")
        assert own in floor, f"{rel}: add its package to FLOORS and docs/architecture.md"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module == "loraplex":
                names = [f"loraplex.{a.name if a.name in floor else public[a.name]}" for a in node.names]
            else:
                names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            for name in names:
                parts = name.split(".")
                if parts[0] != "loraplex" or len(parts) < 2:
                    continue  # another library
                other = parts[1]
                if other != own and floor[other] <= floor[own]:
                    offenders.append(f"{rel}:{node.lineno} imports {name}")
    assert not offenders, offenders
