"""API keys -> tenants, and which served models each tenant may see and use.

A keys file maps tenants to their keys and lists admin keys:

    {"tenants": {"acme": ["sk-acme-1"], "globex": ["sk-globex"]}, "admins": ["sk-root"]}

`--api-key K` alone means one admin key. With neither, the server is open: every caller
is an anonymous admin (local development). Keys are checked before a request's body is
read (server/middleware.py). An adapter belongs to one tenant or is public (owner None);
a tenant sees and uses its own and the public ones, and an adapter it may not see is
reported exactly like one that does not exist, after the same work. Adapters in a
registry (--lora-registry) are addressed as `name` (latest version) or `name@version`
and carry the owner they were published with; an entry published before owners existed
is visible to admins only.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from loraplex.errors import AdapterError, LoraplexError
from loraplex.types import LoRARequest


class Unauthorized(LoraplexError):
    """Missing or unknown API key (401)."""


class Forbidden(LoraplexError):
    """The key is valid but may not do this (403)."""


class ModelNotFound(LoraplexError):
    """No such model, or one this tenant may not see (404)."""

    def __init__(self, name: str):
        super().__init__(f"The model `{name}` does not exist.")


@dataclass(frozen=True)
class Tenant:
    name: str
    admin: bool = False


ANONYMOUS = Tenant("anonymous", admin=True)


class Auth:
    def __init__(self, keys: dict[str, Tenant] | None):
        # By the key's SHA-256: a lookup that takes any bytes and reveals nothing of a
        # key's prefix through its timing. None: an open server.
        self._by_digest = None if keys is None else {_digest(k.encode()): t for k, t in keys.items()}

    @property
    def open(self) -> bool:
        return self._by_digest is None

    @classmethod
    def from_args(cls, api_key: str | None, keys_file: str | None) -> Auth:
        if api_key is None and keys_file is None:
            return cls(None)
        keys: dict[str, Tenant] = {}
        if api_key is not None:
            keys[api_key] = Tenant("admin", admin=True)
        if keys_file is not None:
            data = json.loads(Path(keys_file).read_text())
            for tenant, tenant_keys in data.get("tenants", {}).items():
                for key in tenant_keys:
                    keys[key] = Tenant(tenant)
            for key in data.get("admins", []):
                keys[key] = Tenant("admin", admin=True)
        return cls(keys)

    def authenticate(self, authorization: bytes | None) -> Tenant:
        """The tenant of an Authorization header's raw bytes (any bytes: a header is not
        always ASCII). Raises Unauthorized."""
        if self._by_digest is None:
            return ANONYMOUS
        scheme, _, key = (authorization or b"").strip().partition(b" ")
        if scheme.lower() != b"bearer" or not key.strip():
            raise Unauthorized("missing API key (Authorization: Bearer <key>)")
        tenant = self._by_digest.get(_digest(key.strip()))
        if tenant is None:
            raise Unauthorized("invalid API key")
        return tenant


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


@dataclass
class ServedAdapter:
    lora: LoRARequest
    owner: str | None  # tenant name; None = public


class ServedModels:
    """The base model's name(s) and the adapters served beside it."""

    def __init__(self, base_names: list[str], registry=None):
        self.base_names = base_names
        self.registry = registry  # loraplex.adapters.registry.Registry or None
        self.adapters: dict[str, ServedAdapter] = {}
        self._next_id = 1
        self._registry_ids: dict[str, int] = {}

    def visible(self, tenant: Tenant, adapter: ServedAdapter) -> bool:
        return tenant.admin or adapter.owner is None or adapter.owner == tenant.name

    def resolve(self, name: str, tenant: Tenant) -> LoRARequest | None:
        """The adapter `name` names (None: the base model). Raises ModelNotFound.

        A name the tenant may not see and a name nobody uses take the same path (the
        registry is asked about both), so the answer's timing tells them no more than
        its text. May read the registry: call it off the event loop."""
        if name in self.base_names:
            return None
        adapter = self.adapters.get(name)
        if adapter is not None and self.visible(tenant, adapter):
            return adapter.lora
        entry = self._registry_entry(name)
        if adapter is not None or entry is None or not entry.visible_to(tenant.name, tenant.admin):
            raise ModelNotFound(name)
        if name not in self._registry_ids:
            self._registry_ids[name] = self._next_id
            self._next_id += 1
        return LoRARequest(name, self._registry_ids[name], "")  # the engine resolves it

    def _registry_entry(self, name: str):
        if self.registry is None:
            return None
        base, _, version = name.partition("@")
        try:
            return self.registry.lookup(base, version or None)
        except AdapterError:
            return None

    def listing(self, tenant: Tenant) -> list[tuple[str, ServedAdapter | None]]:
        """What `tenant` may use: base names, adapters, registry names (their latest
        version). Reads the registry's index: call it off the event loop."""
        base = [(name, None) for name in self.base_names]
        served = [(n, a) for n, a in self.adapters.items() if self.visible(tenant, a)]
        registered = []
        for n in self.registry.names() if self.registry else []:
            entry = self._registry_entry(n)
            if n not in self.adapters and entry is not None and entry.visible_to(tenant.name, tenant.admin):
                registered.append((n, ServedAdapter(LoRARequest(n, 1, f"registry:{n}"), entry.owner)))
        return base + served + registered

    def new_adapter(self, name: str, path: str, owner: str | None) -> ServedAdapter:
        lora = LoRARequest(name, self._next_id, path)
        self._next_id += 1
        return ServedAdapter(lora, owner)
