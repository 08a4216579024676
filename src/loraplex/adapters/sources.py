"""Where adapters come from: local directories, URLs (through fsspec), a registry.

A LoRARequest's lora_path is a local directory, a file:// URL, or a remote URL that
fsspec can read (http(s)://, s3:// with s3fs installed, ...). With an empty lora_path
and a registry configured, its lora_name (`name` or `name@version`) is looked up there.
Remote adapters are downloaded into a local disk cache named by content id, so a later
load of the same content, from any URL or name, reads the local copy.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from loraplex.adapters.peft import CONFIG_FILE, FINITE_MARK, MAX_CONFIG_BYTES, WEIGHTS_FILE, shown
from loraplex.adapters.registry import Registry
from loraplex.errors import AdapterError, AdapterNotFound, AdapterTooLarge, AdapterUnavailable
from loraplex.types import LoRARequest


@dataclass(frozen=True)
class AdapterSource:
    name: str  # the adapter's name, for errors and receipts
    uri: str  # a local directory or a remote URL
    remote: bool
    content_id: str | None = None  # known before reading (registry entries)
    # A local directory's files as last stat'ed: rewritten or replaced files are another
    # source (a path names whatever its files hold now, not what they held once).
    stamp: str = ""

    @property
    def key(self) -> str:
        """What identifies the bytes before they are read."""
        return self.content_id or (f"{self.uri}#{self.stamp}" if self.stamp else self.uri)


def resolve(lora: LoRARequest, registry: Registry | None) -> AdapterSource:
    """Cheap, synchronous: raises AdapterNotFound for what is known missing (or a path
    that cannot be read) without I/O beyond local stats or a registry index read."""
    path = lora.lora_path
    try:
        if not path:
            if registry is None:
                raise AdapterNotFound(lora.lora_name, "no lora_path and no adapter registry configured")
            name, _, version = lora.lora_name.partition("@")
            cid = registry.resolve(name, version or None)
            return AdapterSource(lora.lora_name, registry.blob_uri(cid), registry.remote, cid)
        try:
            scheme = urlparse(path).scheme
        except ValueError:  # e.g. "http://[::1"
            raise AdapterNotFound(lora.lora_name, f"{shown(path)} is not a directory or URL") from None
        if scheme in ("", "file") or len(scheme) == 1:  # "C:" style drive letters are local too
            local = Path(path.removeprefix("file://"))
            if not local.is_dir():
                raise AdapterNotFound(lora.lora_name, f"no adapter directory at {shown(str(local))}")
            local = local.resolve()
            return AdapterSource(lora.lora_name, str(local), remote=False, stamp=_stamp(local))
        return AdapterSource(lora.lora_name, path.rstrip("/"), remote=True)
    except OSError as e:  # e.g. ENAMETOOLONG, EACCES; for a registry, its storage
        where = shown(path) if path else "the adapter registry"
        if path or e.errno == errno.ENAMETOOLONG:
            reason = e.strerror or type(e).__name__
            raise AdapterNotFound(lora.lora_name, f"cannot read {where}: {reason}") from None
        reason = f"{type(e).__name__} {shown(str(e))}"
        raise AdapterUnavailable(lora.lora_name, f"cannot read {where}: {reason}") from None


def _stamp(directory: Path) -> str:
    """Size, mtime, inode and ctime of the adapter's two files: cheap, and changed by any
    rewrite or replacement (a missing file is left to the load to report)."""
    parts = []
    for fname in (CONFIG_FILE, WEIGHTS_FILE):
        try:
            st = os.stat(directory / fname)
        except OSError:
            parts.append("-")
        else:
            parts.append(f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:{st.st_ctime_ns}")
    return ",".join(parts)


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


def download(source: AdapterSource, into: Path, timeout: float, max_bytes: int | None = None) -> None:
    """Copy a remote adapter's two files into `into`. Typed errors for missing files and
    unreachable or hanging sources; a weights file over `max_bytes` (or a config over
    MAX_CONFIG_BYTES) whose size the source tells is refused before it is downloaded."""
    import fsspec

    options = {}
    if urlparse(source.uri).scheme in ("http", "https"):
        import aiohttp

        options["client_kwargs"] = {"timeout": aiohttp.ClientTimeout(total=timeout)}
    deadline = time.monotonic() + timeout
    try:
        fs, root = fsspec.core.url_to_fs(source.uri, **options)
        for fname, limit in ((CONFIG_FILE, MAX_CONFIG_BYTES), (WEIGHTS_FILE, max_bytes)):
            size = _remote_size(fs, f"{root}/{fname}") if limit is not None else None
            if size is not None and size > limit:
                raise AdapterTooLarge(source.name, f"{fname} at {shown(source.uri)} is {size} bytes, over "
                                                   f"the {limit} an adapter of rank <= max_lora_rank can be")
            if time.monotonic() > deadline:
                raise TimeoutError(f"download took over {timeout:g} s")
            try:  # (fs.exists would hide connection errors as "missing")
                fs.get_file(f"{root}/{fname}", str(into / fname))
            except FileNotFoundError:
                if fname == WEIGHTS_FILE and fs.exists(f"{root}/adapter_model.bin"):
                    (into / "adapter_model.bin").touch()  # read_adapter_dir reports it
                    return
                raise AdapterNotFound(source.name, f"no {fname} at {shown(source.uri)}") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"download took over {timeout:g} s")
    except AdapterError:
        raise
    except TimeoutError as e:  # (also asyncio's and fsspec's) the same words as the manager's deadline
        raise AdapterUnavailable(source.name, f"not loaded within {timeout:g} s from {shown(source.uri)} "
                                              f"({type(e).__name__})") from None
    except Exception as e:  # fsspec backends raise their own types (aiohttp, botocore, ...)
        raise AdapterUnavailable(source.name, f"cannot read {shown(source.uri)}: {type(e).__name__} "
                                              f"{shown(str(e))}") from None


def _remote_size(fs, path: str) -> int | None:
    """The remote file's size where its source tells it before the download; None where it
    does not or the query failed (fsspec's HTTP info calls every failure "not found": the
    download itself reports what went wrong)."""
    try:
        size = fs.size(path)
    except Exception:
        return None
    return size if isinstance(size, int) else None
