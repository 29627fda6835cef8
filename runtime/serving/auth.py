"""Bearer keys: which tenant a request belongs to, and whether it may run admin routes.

Takes runtime/security/api_keys.py's `ApiKeys` (anything with `lookup(key) -> Principal | None`) or a
plain mapping key -> principal (anything with `.tenant` and `.admin`). Without keys the door is
open and every caller an admin, but callers still do not share cached KV unless the operator
says so (`shared_open_cache`): a shared cache tells one caller, by its speed, which prompts
another sent. Each caller gets a tenant of its own: the SHA-256 of the bearer token it presents
(any token: OpenAI clients always send one), else its address. So callers that present the same
token, or come from one address without a token (several behind one proxy), share a namespace;
keys are the way to tell callers apart for sure.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Protocol

from starlette.requests import Request

from hicache.runtime.security.api_keys import OPEN, Principal, digest
from hicache.runtime.serving.errors import ApiError


class PrincipalLike(Protocol):
    @property
    def tenant(self) -> str | None: ...

    @property
    def admin(self) -> bool: ...


class KeyLookup(Protocol):
    def lookup(self, key: object) -> PrincipalLike | None: ...


class _DigestMap:
    """A plain mapping looked up by SHA-256, as `ApiKeys` does: the time a lookup takes says
    nothing about how much of a wrong key was right."""

    def __init__(self, keys: Mapping[str, PrincipalLike]) -> None:
        self._by_digest = {digest(k): p for k, p in keys.items()}

    def lookup(self, key: object) -> PrincipalLike | None:
        if not isinstance(key, str) or len(key) > 4096:
            return None
        try:
            return self._by_digest.get(digest(key))
        except UnicodeEncodeError:
            return None


def open_caller(request: Request) -> Principal:
    """A caller of an open door: an admin whose tenant is its bearer token's hash, else its
    address (module notes)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    token = token.strip()
    if scheme.lower() == "bearer" and token:
        name = "token:" + hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    else:
        name = "address:" + (request.client.host if request.client is not None else "unknown")
    return Principal(tenant=name, admin=True)


class Auth:
    def __init__(
        self, keys: KeyLookup | Mapping[str, PrincipalLike] | None, *, shared_open_cache: bool = False
    ) -> None:
        self.shared_open_cache = shared_open_cache
        if keys is None or hasattr(keys, "lookup"):
            self._keys: KeyLookup | None = keys  # type: ignore[assignment]
        else:
            self._keys = _DigestMap(keys)

    @property
    def enabled(self) -> bool:
        return self._keys is not None

    def caller(self, request: Request) -> str:
        """Who an open door's caller is, for its limits: its namespace as `open_caller` names
        it, even where callers share one cache (`shared_open_cache`)."""
        return open_caller(request).tenant or "unknown"

    def principal(self, request: Request, *, admin: bool = False) -> PrincipalLike:
        """The caller, or a 401 (no or unknown key) / 403 (an admin route, a tenant's key)."""
        if self._keys is None:
            return OPEN if self.shared_open_cache else open_caller(request)
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        found = self._keys.lookup(key.strip()) if scheme.lower() == "bearer" else None
        if found is None:
            raise ApiError(
                401, "a valid API key is required (Authorization: Bearer KEY)", code="invalid_api_key"
            )
        if admin and not found.admin:
            raise ApiError(403, "this route needs an admin key", type="permission_error", code="forbidden")
        return found
