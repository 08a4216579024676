"""Running the real HTTP server in tests: a uvicorn server on a free loopback port in a
thread, clients for it, and the tiny chat model it serves."""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import threading
import time
from pathlib import Path

import openai
from conftest import DEVICE
from transformers import PreTrainedTokenizerFast

ADMIN, ACME, GLOBEX = "sk-admin", "sk-acme", "sk-globex"
KEYS = {"tenants": {"acme": [ACME], "globex": [GLOBEX]}, "admins": [ADMIN]}
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_chat_model(src: Path, dst: Path) -> Path:
    """A copy of a tiny model whose chat template joins the messages' words."""
    shutil.copytree(src, dst)
    tok = PreTrainedTokenizerFast.from_pretrained(dst)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(dst)
    return dst


def serve_args(model_dir, *extra) -> list[str]:
    return [str(model_dir), "--max-model-len", "96", "--dtype", "float32", "--max-num-seqs", "32",
            "--max-loras", "4", "--max-lora-rank", "16", "--device", DEVICE, *extra]


def tenant_serve_args(model_dir, adapter_dirs, keys_dir: Path, *extra) -> list[str]:
    """serve_args for a server with API keys (KEYS) serving the tiny model as "tiny", a
    public adapter "public-ad" and one of tenant acme's, "acme-ad"."""
    keys = keys_dir / "keys.json"
    keys.write_text(json.dumps(KEYS))
    ads = adapter_dirs["qwen3"]
    return serve_args(model_dir, "--api-keys-file", str(keys), "--served-model-name", "tiny",
                      "--lora-modules", f"public-ad={ads['all7-r8']}",
                      json.dumps({"name": "acme-ad", "path": str(ads["qv-r4-rslora"]), "tenant": "acme"}),
                      *extra)


def parse_serve_args(argv: list[str]) -> argparse.Namespace:
    from loraplex.server.run import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def running(argv: list[str]):
    """Build the server for `loraplex serve` arguments and serve it; yields the Server
    with .url (a generator for module fixtures)."""
    import uvicorn

    from loraplex.server.run import build_server

    srv, app = build_server(parse_serve_args(argv))
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.02)
    srv.url = f"http://127.0.0.1:{port}"
    yield srv
    uv.should_exit = True
    thread.join(10)


def client(server, key=ADMIN) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def idle(server, timeout=5.0) -> bool:
    """The server has no request in flight and the engine nothing to run."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.engine.num_in_flight == 0 and not server.engine.engine.has_unfinished_requests():
            return True
        time.sleep(0.02)
    return False
