"""Who a client is: API keys mapped to tenants and to the admin role.

A decode node given `--api-keys FILE` serves only clients that present a key from it; the key,
not the client, says which tenant the requests belong to (the tenant salts every cache key, so
tenants never share KV) and whether the client may run admin operations (`stats`, `audit`,
`evict` — flushing everyone's cached pages — and `idle`). The file is TOML:

    [[key]]
    key = "sk-acme-3f9a..."          # or key_sha256 = "<hex>", to keep the key itself elsewhere
    tenant = "acme"

    [[key]]
    key_sha256 = "9c1e..."
    admin = true                     # an admin key's own requests use `tenant` if it has one

Keys are looked up by their SHA-256, so the time a lookup takes says nothing about how much of
a wrong key was right, and a file of digests holds nothing a reader could present. Without a
file the node is open: every client is an admin and may name its own tenant (a single-operator
set-up; the node says so in its log at start).

The file is refused, as ssh refuses a private key or an `authorized_keys` file others can touch,
when anyone but its owner could change it (group or other write permission: they could add an
admin key), when it is owned by someone other than this user or root, and when it holds a key
itself (`key = ...`) and others may read it (group or other read permission: `chmod 600 FILE`).
A file of `key_sha256` digests alone may be readable by others.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import tomllib
from pathlib import Path
from typing import Any

import attrs

MIN_KEY_CHARS = 16
MAX_TENANT_CHARS = 256
MAX_FILE_BYTES = 16 << 20
_HEX64 = re.compile(r"[0-9a-f]{64}")


class ApiKeyError(ValueError):
    """An API key file that cannot be used; the message names the file, entry and field."""


@attrs.frozen
class Principal:
    """What a key grants: the tenant of its requests (None: the shared namespace) and admin."""

    tenant: str | None
    admin: bool


OPEN = Principal(tenant=None, admin=True)  # every client of a node without API keys


def digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


@attrs.frozen
class ApiKeys:
    """Key digest -> principal."""

    principals: dict[str, Principal]
    source: str = "argument"

    def lookup(self, key: object) -> Principal | None:
        """The principal of `key`, or None for anything that is not one of the keys."""
        if not isinstance(key, str) or len(key) > 4096:
            return None
        try:
            return self.principals.get(digest(key))
        except UnicodeEncodeError:  # a lone surrogate: not a key
            return None

    @classmethod
    def load(cls, path: Path) -> ApiKeys:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                with os.fdopen(os.dup(fd), "rb") as f:
                    raw = f.read(MAX_FILE_BYTES + 1)
            finally:
                os.close(fd)
        except OSError as exc:
            raise ApiKeyError(f"{path}: cannot read it ({exc.strerror or exc})") from None
        if not stat.S_ISREG(st.st_mode):
            raise ApiKeyError(f"{path}: not a regular file")
        if len(raw) > MAX_FILE_BYTES:
            raise ApiKeyError(f"{path}: larger than {MAX_FILE_BYTES} bytes")
        mode = stat.S_IMODE(st.st_mode)
        if st.st_uid not in (os.geteuid(), 0):
            raise ApiKeyError(f"{path}: owned by uid {st.st_uid}, not by this user ({os.geteuid()}) or root")
        if mode & 0o022:
            raise ApiKeyError(
                f"{path}: mode {mode:04o} lets others change it (and add an admin key); chmod go-w it"
            )
        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ApiKeyError(f"{path}: not TOML ({exc})") from None
        keys = cls.parse(data, str(path))
        if mode & 0o044 and any(isinstance(e, dict) and "key" in e for e in data["key"]):
            raise ApiKeyError(
                f"{path}: mode {mode:04o} lets others read the API keys in it; chmod 600 it, or keep "
                "only key_sha256 digests in a file others may read"
            )
        return keys

    @classmethod
    def parse(cls, data: dict[str, Any], source: str) -> ApiKeys:
        extra = set(data) - {"key"}
        if extra:
            raise ApiKeyError(f"{source}: unknown table {sorted(extra)[0]!r}; expected [[key]] entries")
        entries = data.get("key")
        if not isinstance(entries, list) or not entries:
            raise ApiKeyError(f"{source}: expected at least one [[key]] entry")
        principals: dict[str, Principal] = {}
        for n, entry in enumerate(entries, 1):
            where = f"{source}: [[key]] #{n}"
            hashed = _entry_digest(entry, where)
            if hashed in principals:
                raise ApiKeyError(f"{where}: the same key appears twice")
            principals[hashed] = _principal(entry, where)
        return cls(principals, source)


def _entry_digest(entry: object, where: str) -> str:
    if not isinstance(entry, dict):
        raise ApiKeyError(f"{where}: expected a table")
    unknown = set(entry) - {"key", "key_sha256", "tenant", "admin"}
    if unknown:
        raise ApiKeyError(f"{where}: unknown field {sorted(unknown)[0]!r}")
    if ("key" in entry) == ("key_sha256" in entry):
        raise ApiKeyError(f"{where}: expected exactly one of 'key' and 'key_sha256'")
    if "key" in entry:
        key = entry["key"]
        if not isinstance(key, str) or len(key) < MIN_KEY_CHARS:
            raise ApiKeyError(f"{where}: field 'key' must be a string of at least {MIN_KEY_CHARS} characters")
        return digest(key)
    hashed = entry["key_sha256"]
    if not isinstance(hashed, str) or not _HEX64.fullmatch(hashed.lower()):
        raise ApiKeyError(f"{where}: field 'key_sha256' must be 64 hex digits (SHA-256 of the key)")
    return hashed.lower()


def _principal(entry: dict[str, Any], where: str) -> Principal:
    admin = entry.get("admin", False)
    if not isinstance(admin, bool):
        raise ApiKeyError(f"{where}: field 'admin' must be true or false")
    tenant = entry.get("tenant")
    if tenant is None and not admin:
        raise ApiKeyError(f"{where}: field 'tenant' is required for a key that is not an admin's")
    if tenant is not None and not (isinstance(tenant, str) and 0 < len(tenant) <= MAX_TENANT_CHARS):
        raise ApiKeyError(f"{where}: field 'tenant' must be a string of 1 to {MAX_TENANT_CHARS} characters")
    return Principal(tenant, admin)
