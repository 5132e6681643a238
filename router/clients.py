"""Who sent a request: the client that admission shares the router among.

A client is its API key when keys are configured (``--api-key``, or several in the file named
by ``--api-keys-file``), else the peer's address. Forwarded-for headers are not trusted: behind
a proxy, give each tenant a key.

The keys file is JSON, a list of keys, each with a name (logs and metrics show the name, never
the key), the key, and optionally its weight (its share of the router relative to the others,
default 1) and its cache salt (default: one derived from the key, so that no two keys share
cached prompt blocks; ``""`` opts a key out)::

    [{"name": "team-a", "key": "sk-...", "weight": 2},
     {"name": "batch", "key": "sk-...", "weight": 0.5}]
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from router.errors import APIError


@dataclass(frozen=True)
class Client:
    """One party admission shares slots among."""

    id: str  # "key:<name>" or "addr:<host>": the fairness key
    weight: float = 1.0
    cache_salt: str | None = None  # the salt of its requests that name none


class _KeyEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64)
    key: str = Field(min_length=8, max_length=512)
    weight: float = Field(default=1.0, gt=0, le=1000)
    cache_salt: str | None = Field(default=None, max_length=256)


@dataclass(frozen=True)
class _Key:
    secret: bytes
    client: Client


class ClientKeys:
    """The configured API keys (none: the API is open and clients are told apart by address)."""

    def __init__(self, keys: list[_Key]):
        self._keys = keys

    @classmethod
    def single(cls, key: str) -> ClientKeys:
        return cls([_Key(key.encode(), Client("key:default"))])

    @classmethod
    def load(cls, api_key: str | None, keys_file: str | None) -> ClientKeys:
        keys = cls.single(api_key)._keys if api_key is not None else []  # one tenant: no salt
        if keys_file is not None:
            for entry in _read_entries(Path(keys_file)):
                salt = entry.cache_salt
                if salt is None:
                    salt = hashlib.sha256(b"pdserve-cache-salt:" + entry.key.encode()).hexdigest()
                client = Client(f"key:{entry.name}", entry.weight, salt or None)
                keys.append(_Key(entry.key.encode(), client))
        names = [k.client.id for k in keys]
        if len(set(names)) != len(names):
            raise ValueError(f"API key names must be unique, got {names}")
        return cls(keys)

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def client(self, headers: Any, address: str | None) -> Client:
        """The request's client; a 401 when keys are configured and it carries none of them.
        Every key is compared in constant time, so the answer's timing tells nothing."""
        if not self._keys:
            return Client(f"addr:{address or 'unknown'}")
        header = next((v for k, v in headers if k == b"authorization"), b"")
        if not header:
            raise APIError(
                401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
            )
        scheme, _, key = header.partition(b" ")
        found = None
        for entry in self._keys:
            if hmac.compare_digest(key.strip(), entry.secret) and scheme.lower() == b"bearer":
                found = entry.client
        if found is None:
            raise APIError(401, "incorrect API key", code="invalid_api_key")
        return found


def _read_entries(path: Path) -> list[_KeyEntry]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--api-keys-file {str(path)!r}: {exc}") from exc
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"--api-keys-file {str(path)!r}: expected a non-empty JSON list of keys")
    try:
        return [_KeyEntry.model_validate(item) for item in raw]
    except ValidationError as exc:
        raise ValueError(f"--api-keys-file {str(path)!r}: {exc}") from exc
