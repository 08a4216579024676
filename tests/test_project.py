"""The project's own front door: the README's examples and the Makefile's commands."""

from __future__ import annotations

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
