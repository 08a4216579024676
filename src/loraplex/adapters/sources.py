"""Where adapters come from: local directories, URLs (through fsspec), a registry.

A LoRARequest's lora_path is a local directory, a file:// URL, or a remote URL that
fsspec can read (http(s)://, s3:// with s3fs installed, ...). With an empty lora_path
and a registry configured, its lora_name (`name` or `name@version`) is looked up there.
Remote adapters are downloaded into a local disk cache named by content id, so a later
load of the same content, from any URL or name, reads the local copy.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from loraplex.adapters.peft import CONFIG_FILE, FINITE_MARK, WEIGHTS_FILE
from loraplex.adapters.registry import Registry
from loraplex.errors import AdapterNotFound, AdapterUnavailable
from loraplex.types import LoRARequest


@dataclass(frozen=True)
class AdapterSource:
    name: str  # the adapter's name, for errors and receipts
    uri: str  # a local directory or a remote URL
    remote: bool
    content_id: str | None = None  # known before reading (registry entries)

    @property
    def key(self) -> str:
        """What identifies the bytes before they are read."""
        return self.content_id or self.uri


def resolve(lora: LoRARequest, registry: Registry | None) -> AdapterSource:
    """Cheap, synchronous: raises AdapterNotFound for what is known missing without I/O
    beyond a local stat or a registry index read."""
    path = lora.lora_path
    if not path:
        if registry is None:
            raise AdapterNotFound(lora.lora_name, "no lora_path and no adapter registry configured")
        name, _, version = lora.lora_name.partition("@")
        cid = registry.resolve(name, version or None)
        return AdapterSource(lora.lora_name, registry.blob_uri(cid), registry.remote, cid)
    scheme = urlparse(path).scheme
    if scheme in ("", "file") or len(scheme) == 1:  # "C:" style drive letters are local too
        local = path.removeprefix("file://")
        if not Path(local).is_dir():
            raise AdapterNotFound(lora.lora_name, f"no adapter directory at {local!r}")
        return AdapterSource(lora.lora_name, str(Path(local).resolve()), remote=False)
    return AdapterSource(lora.lora_name, path.rstrip("/"), remote=True)


class DiskCache:
    """Downloaded adapters on local disk, one directory per content id, least recently
    used dropped past `max_bytes`."""

    def __init__(self, root: str | Path, max_bytes: int):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()  # workers commit concurrently

    def path(self, content_id: str) -> Path:
        return self.root / content_id.replace(":", "-")

    def lookup(self, content_id: str) -> Path | None:
        p = self.path(content_id)
        if (p / WEIGHTS_FILE).is_file():
            os.utime(p)  # mark recently used
            return p
        return None

    def staging(self) -> Path:
        return Path(tempfile.mkdtemp(prefix=".incoming-", dir=self.root))

    def commit(self, staged: Path, content_id: str) -> Path:
        """Keep a download whose load validated it (its weights finite: FINITE_MARK)."""
        final = self.path(content_id)
        (staged / FINITE_MARK).touch()
        with self._lock:
            try:
                staged.rename(final)
            except OSError:  # another load of the same content got there first
                shutil.rmtree(staged, ignore_errors=True)
            self._trim(keep=final)
        return final

    def _trim(self, keep: Path) -> None:
        entries = [(p.stat().st_mtime, p) for p in self.root.iterdir() if not p.name.startswith(".")]
        sizes = {p: sum(f.stat().st_size for f in p.iterdir()) for _, p in entries}
        total = sum(sizes.values())
        for _, p in sorted(entries):
            if total <= self.max_bytes:
                break
            if p != keep:
                shutil.rmtree(p, ignore_errors=True)
                total -= sizes[p]


def download(source: AdapterSource, into: Path, timeout: float) -> None:
    """Copy a remote adapter's two files into `into`. Typed errors for missing files and
    unreachable or hanging sources."""
    import fsspec

    options = {}
    if urlparse(source.uri).scheme in ("http", "https"):
        import aiohttp

        options["client_kwargs"] = {"timeout": aiohttp.ClientTimeout(total=timeout)}
    deadline = time.monotonic() + timeout
    try:
        fs, root = fsspec.core.url_to_fs(source.uri, **options)
        for fname in (CONFIG_FILE, WEIGHTS_FILE):
            try:  # (fs.exists would hide connection errors as "missing")
                fs.get_file(f"{root}/{fname}", str(into / fname))
            except FileNotFoundError:
                if fname == WEIGHTS_FILE and fs.exists(f"{root}/adapter_model.bin"):
                    (into / "adapter_model.bin").touch()  # read_adapter_dir reports it
                    return
                raise AdapterNotFound(source.name, f"no {fname} at {source.uri}") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"download took over {timeout:g} s")
    except AdapterNotFound:
        raise
    except TimeoutError as e:  # (also asyncio's and fsspec's) the same words as the manager's deadline
        raise AdapterUnavailable(source.name, f"not loaded within {timeout:g} s from {source.uri} "
                                              f"({type(e).__name__})") from None
    except Exception as e:  # fsspec backends raise their own types (aiohttp, botocore, ...)
        raise AdapterUnavailable(source.name, f"cannot read {source.uri}: {type(e).__name__} {e}") from None
