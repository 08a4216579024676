"""`loraplex serve`: build the engine and serve the OpenAI-compatible API with uvicorn.

Flags keep vLLM's names. On SIGTERM / SIGINT the server drains: new requests get 503,
running ones have --shutdown-timeout seconds to finish, the rest end with an explicit
error, and only then does uvicorn close its connections. Another signal during the drain
ends every unfinished request at once, still each with its error event.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket

from loraplex.engine.args import EngineArgs
from loraplex.errors import LoraplexError
from loraplex.server.tools import PARSERS, parser_for_template

logger = logging.getLogger("loraplex")

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="model directory (default: Gemma 3 270M, built on first use, with its demo "
                        "adapters)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="one admin key (Authorization: Bearer KEY)")
    p.add_argument("--api-keys-file", default=None,
                   help='JSON {"tenants": {name: [keys]}, "admins": [keys]}')
    p.add_argument("--lora-modules", nargs="*", default=[], metavar="NAME=PATH",
                   help='adapters served from the start: NAME=PATH (public) or JSON '
                        '{"name": ..., "path": ..., "tenant": ...}; with the default model and '
                        'none given, the demo adapters `terse` and `json`')
    p.add_argument("--no-demo-adapters", action="store_true",
                   help="serve the default model without its demo adapters")
    p.add_argument("--served-model-name", nargs="*", default=None)
    p.add_argument("--pinned-loras", nargs="*", default=[], metavar="NAME",
                   help="--lora-modules names kept in host memory and a GPU slot for good")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish on SIGTERM / SIGINT (a second "
                        "signal ends them at once, each with an explicit error)")
    p.add_argument("--public-metrics", action="store_true",
                   help="serve /metrics without an API key (every other path needs one when keys "
                        "are configured; /health never does)")
    p.add_argument("--max-request-bytes", type=int, default=16 * 2**20,
                   help="largest request body accepted (413 beyond it)")
    p.add_argument("--stream-write-timeout", type=float, default=60.0,
                   help="seconds a streaming client may accept no data before it is disconnected "
                        "and its request aborted")
    p.add_argument("--tool-call-parser", choices=sorted(PARSERS), default=None,
                   help="the format tool_choice auto reads calls in (default: recognised from the "
                        "chat template; without one, auto is refused)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="vLLM's flag: require a tool-call format (given or recognised) at startup")
    EngineArgs.add_cli_args(p)


def parse_lora_module(spec: str) -> tuple[str, str, str | None]:
    """NAME=PATH or JSON -> (name, path, tenant or None)."""
    if spec.lstrip().startswith("{"):
        d = json.loads(spec)
        return d["name"], d["path"], d.get("tenant")
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise SystemExit(f"--lora-modules expects NAME=PATH or JSON, got {spec!r}")
    return name, path, None


def build_server(args):
    """The engine, the served models and the FastAPI app for `args` (a model directory:
    the default model is chosen above, by the `loraplex serve` command)."""
    from loraplex.engine.async_engine import AsyncEngine
    from loraplex.server.api import Server, build_app
    from loraplex.server.auth import Auth, ServedModels

    if args.model is None:
        raise LoraplexError("no model directory to serve")
    llm_engine = EngineArgs.from_cli_args(args).create_engine()
    names = args.served_model_name or [args.model]
    served = ServedModels(names, llm_engine.adapters.registry if llm_engine.adapters else None)
    if args.pinned_loras and len(args.pinned_loras) >= args.max_loras:
        raise SystemExit("--pinned-loras must leave at least one of --max-loras slots free")
    modules = list(args.lora_modules)
    unknown = set(args.pinned_loras) - {parse_lora_module(s)[0] for s in modules}
    if unknown:
        raise SystemExit(f"--pinned-loras names no --lora-modules adapter: {sorted(unknown)}")
    for spec in modules:  # pre-warmed into host memory; broken ones stop the server
        name, path, tenant = parse_lora_module(spec)
        adapter = served.new_adapter(name, path, tenant)
        llm_engine.load_adapter(adapter.lora, pin=name in args.pinned_loras)
        served.adapters[name] = adapter
    parser = PARSERS[args.tool_call_parser] if args.tool_call_parser else None
    if args.enable_auto_tool_choice and parser is None and parser_for_template(
            getattr(llm_engine.tokenizer, "chat_template", None)) is None:
        raise SystemExit("--enable-auto-tool-choice: the chat template's tool-call format is not one "
                         f"loraplex recognises; name it with --tool-call-parser ({', '.join(PARSERS)})")
    engine = AsyncEngine(llm_engine)
    server = Server(engine, llm_engine.tokenizer, Auth.from_args(args.api_key, args.api_keys_file),
                    served, llm_engine.config.scheduler.max_model_len, args.stream_write_timeout, parser)
    server.replica_name = getattr(args, "replica_name", None)  # set by a launcher of several
    return server, build_app(server, args.shutdown_timeout, args.public_metrics, args.max_request_bytes)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, taken before the model loads: a port in use fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise LoraplexError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


def main(args: argparse.Namespace, sock: socket.socket | None = None) -> int:
    """Serve until a signal; `sock`: the listening socket, if the caller bound it already."""
    import uvicorn

    sock = sock or bind(args.host, args.port)
    server, app = build_server(args)

    class DrainingServer(uvicorn.Server):
        """uvicorn closes connections on its first signal and cuts them on its second:
        it hears of one signal only, after the drain has ended every request."""

        def handle_exit(self, sig, frame):
            loop = asyncio.get_event_loop()
            if getattr(self, "_draining", False):  # end the drain now
                logger.info("signal %d again: ending every unfinished request now", sig)
                loop.call_soon_threadsafe(server.engine.hurry)
                return
            self._draining = True
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain(sig, frame)))

        async def _drain(self, sig, frame):
            await server.engine.shutdown(args.shutdown_timeout)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=5)
    adapters = f" (adapters: {', '.join(server.served.adapters)})" if server.served.adapters else ""
    logger.info("serving %s%s on http://%s:%d", ", ".join(server.served.base_names), adapters,
                args.host, args.port)
    DrainingServer(config).run(sockets=[sock])
    return 0
