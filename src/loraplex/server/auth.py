"""API keys -> tenants, and which served models each tenant may see and use.

A keys file maps tenants to their keys and lists admin keys:

    {"tenants": {"acme": ["sk-acme-1"], "globex": ["sk-globex"]}, "admins": ["sk-root"]}

`--api-key K` alone means one admin key. With neither, the server is open: every caller
is an anonymous admin (local development). An adapter belongs to one tenant or is public
(owner None); a tenant sees and uses its own and the public ones, and an adapter it may
not see is reported exactly like one that does not exist. Adapters in a registry
(--lora-registry) are public and addressed as `name` (latest version) or `name@version`.
"""

from __future__ import annotations

import json
import secrets
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
        self.keys = keys  # None: open server

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

    def authenticate(self, authorization: str | None) -> Tenant:
        if self.keys is None:
            return ANONYMOUS
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise Unauthorized("missing API key (Authorization: Bearer <key>)")
        for known, tenant in self.keys.items():
            if secrets.compare_digest(known, key):
                return tenant
        raise Unauthorized("invalid API key")


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
        """The adapter `name` names (None: the base model). Raises ModelNotFound."""
        if name in self.base_names:
            return None
        adapter = self.adapters.get(name)
        if adapter is None and self.registry is not None:
            return self._from_registry(name)
        if adapter is None or not self.visible(tenant, adapter):
            raise ModelNotFound(name)
        return adapter.lora

    def _from_registry(self, name: str) -> LoRARequest:
        base, _, version = name.partition("@")
        try:
            self.registry.resolve(base, version or None)
        except AdapterError:
            raise ModelNotFound(name) from None
        if name not in self._registry_ids:
            self._registry_ids[name] = self._next_id
            self._next_id += 1
        return LoRARequest(name, self._registry_ids[name], "")  # the engine resolves it

    def listing(self, tenant: Tenant) -> list[tuple[str, ServedAdapter | None]]:
        base = [(name, None) for name in self.base_names]
        registered = [(n, ServedAdapter(LoRARequest(n, 1, f"registry:{n}"), None))
                      for n in (self.registry.names() if self.registry else []) if n not in self.adapters]
        return base + [(n, a) for n, a in self.adapters.items() if self.visible(tenant, a)] + registered

    def new_adapter(self, name: str, path: str, owner: str | None) -> ServedAdapter:
        lora = LoRARequest(name, self._next_id, path)
        self._next_id += 1
        return ServedAdapter(lora, owner)
