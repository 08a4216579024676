"""A registry of named, versioned adapters, content addressed.

Layout (a local directory or any fsspec URL):

    ROOT/index/NAME.json      {"versions": {"1": "sha256:...", ...}, "latest": "1",
                               "owner": "acme"}   (null: public)
    ROOT/blobs/sha256-HEX/    adapter_config.json, adapter_model.safetensors

`name@version` resolves to a content id; `name` alone to its latest version, read at
each resolve, so publishing a new version switches new requests at once (requests
already running keep the content they resolved). Identical content published twice is
stored once. Every name has an owner, a tenant or public, given at its first publish
and kept by later versions; a server shows an entry only to its owner's tenant (every
tenant if public) and admins. An index written before owners existed has no "owner"
field: admins only, until a publish names one.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from loraplex.errors import AdapterInvalid, AdapterNotFound

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
FILES = ("adapter_config.json", "adapter_model.safetensors")


@dataclass(frozen=True)
class RegistryEntry:
    content_id: str
    owner: str | None  # the tenant that may use it; None: every tenant
    admins_only: bool = False  # published before owners existed

    def visible_to(self, tenant: str, admin: bool) -> bool:
        return admin or (not self.admins_only and self.owner in (None, tenant))


def _owner_name(owner: str | None) -> str:
    return "every tenant (public)" if owner is None else f"tenant {owner!r}"


class Registry:
    def __init__(self, root: str):
        import fsspec

        self.root = root.rstrip("/")
        self.fs, self._path = fsspec.core.url_to_fs(self.root)
        self.remote = "file" not in (self.fs.protocol if isinstance(self.fs.protocol, tuple)
                                     else (self.fs.protocol,))

    def exists(self) -> bool:
        return self.fs.exists(self._path)

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

    def lookup(self, name: str, version: str | None = None) -> RegistryEntry:
        """`name` (its latest version) or `name@version`; raises AdapterNotFound."""
        index = self.index(name) if _NAME.match(name) else {"versions": {}}
        version = version or index.get("latest")
        if version not in index["versions"]:
            what = f"{name}@{version}" if version else name
            raise AdapterNotFound(name, f"{what} is not in the registry at {self.root}")
        return RegistryEntry(index["versions"][version], index.get("owner"), "owner" not in index)

    def resolve(self, name: str, version: str | None = None) -> str:
        """The content id of `name` or `name@version`."""
        return self.lookup(name, version).content_id

    def publish(self, name: str, adapter_dir: str | Path, version: str | None = None,
                link: bool = False, *, owner: str | None) -> tuple[str, str]:
        """Add `adapter_dir` as a new version of `name` (the next integer unless given)
        and make it the latest; the same content as the latest is not a new version.
        `owner` is the tenant that may use it, None for every tenant; a name keeps the
        owner of its first publish (an index without one takes it). With `link`, a
        local registry hard-links the files instead of copying them (the source must
        then never change). Returns (version, content id)."""
        from loraplex.adapters.manifest import content_id
        from loraplex.adapters.peft import FINITE_MARK, all_finite, read_adapter_dir

        if not _NAME.match(name):
            raise ValueError(f"adapter names are letters, digits, '.', '_' and '-': {name!r}")
        index = self.index(name)
        if "owner" in index and index["owner"] != owner:
            raise ValueError(f"{name!r} belongs to {_owner_name(index['owner'])}, "
                             f"not {_owner_name(owner)}")
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
        if version is None and index["versions"].get(index["latest"]) == cid:
            if "owner" not in index:  # an index from before owners: it takes this one
                self._write_index(name, {**index, "owner": owner})
            return index["latest"], cid  # republishing the latest content changes nothing
        index["owner"] = owner
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
