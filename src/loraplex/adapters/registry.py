"""A registry of named, versioned adapters, content addressed.

Layout (a local directory or any fsspec URL):

    ROOT/index/NAME.json      {"versions": {"1": "sha256:...", ...}, "latest": "1"}
    ROOT/blobs/sha256-HEX/    adapter_config.json, adapter_model.safetensors

`name@version` resolves to a content id; `name` alone to its latest version, read at
each resolve, so publishing a new version switches new requests at once (requests
already running keep the content they resolved). Identical content published twice is
stored once.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

from loraplex.errors import AdapterInvalid, AdapterNotFound

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
FILES = ("adapter_config.json", "adapter_model.safetensors")


class Registry:
    def __init__(self, root: str):
        import fsspec

        self.root = root.rstrip("/")
        self.fs, self._path = fsspec.core.url_to_fs(self.root)
        self.remote = "file" not in (self.fs.protocol if isinstance(self.fs.protocol, tuple)
                                     else (self.fs.protocol,))

    def blob_uri(self, content_id: str) -> str:
        blob = f"blobs/{content_id.replace(':', '-')}"
        return f"{self.root}/{blob}" if self.remote else str(Path(self._path) / blob)

    def _index_path(self, name: str) -> str:
        return f"{self._path}/index/{name}.json"

    def index(self, name: str) -> dict:
        try:
            return json.loads(self.fs.cat_file(self._index_path(name)))
        except FileNotFoundError:
            return {"versions": {}, "latest": None}

    def names(self) -> list[str]:
        try:
            files = self.fs.ls(f"{self._path}/index", detail=False)
        except FileNotFoundError:
            return []
        return sorted(Path(f).stem for f in files if f.endswith(".json"))

    def resolve(self, name: str, version: str | None = None) -> str:
        index = self.index(name) if _NAME.match(name) else {"versions": {}}
        version = version or index.get("latest")
        if version not in index["versions"]:
            what = f"{name}@{version}" if version else name
            raise AdapterNotFound(name, f"{what} is not in the registry at {self.root}")
        return index["versions"][version]

    def publish(self, name: str, adapter_dir: str | Path, version: str | None = None,
                link: bool = False) -> tuple[str, str]:
        """Add `adapter_dir` as a new version of `name` (the next integer unless given)
        and make it the latest; the same content as the latest is not a new version.
        With `link`, a local registry hard-links the files instead of copying them (the
        source must then never change). Returns (version, content id)."""
        from loraplex.adapters.manifest import content_id
        from loraplex.adapters.peft import FINITE_MARK, all_finite, read_adapter_dir

        if not _NAME.match(name):
            raise ValueError(f"adapter names are letters, digits, '.', '_' and '-': {name!r}")
        config, tensors = read_adapter_dir(name, adapter_dir)
        # Checked once, here (the blob then holds FINITE_MARK): loads of a published blob
        # skip this pass over its bytes, as they skip its content id.
        if not all_finite(tensors):
            raise AdapterInvalid(name, "has NaN or infinite weights; not published")
        cid = content_id(config, tensors)
        blob = self.blob_uri(cid)
        if not self.fs.exists(f"{blob}/{FILES[1]}"):
            self.fs.makedirs(blob, exist_ok=True)
            for f in FILES:
                if link and not self.remote:
                    os.link(Path(adapter_dir) / f, Path(blob) / f)
                else:
                    self.fs.put_file(str(Path(adapter_dir) / f), f"{blob}/{f}")
        self.fs.pipe_file(f"{blob}/{FINITE_MARK}", b"")
        index = self.index(name)
        if version is None and index["versions"].get(index["latest"]) == cid:
            return index["latest"], cid  # republishing the latest content changes nothing
        if version is None:
            version = str(1 + max((int(v) for v in index["versions"] if v.isdigit()), default=0))
        index["versions"][version] = cid
        index["latest"] = version
        self._write_index(name, index)
        return version, cid

    def _write_index(self, name: str, index: dict) -> None:
        data = json.dumps(index, indent=1, sort_keys=True)
        target = self._index_path(name)
        self.fs.makedirs(f"{self._path}/index", exist_ok=True)
        if self.remote:
            self.fs.pipe_file(target, data.encode())
            return
        # Readers never see a half-written index: write beside it, then rename over it.
        fd, tmp = tempfile.mkstemp(dir=Path(target).parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(data)
        os.replace(tmp, target)
