"""The cluster secret: what a node proves it holds before any peer acts on what it says.

Every connection between nodes — a decode node's control connection to its prefill node, and
every connection of the transfer engines — opens with a challenge–response over this secret
(`runtime/security/peer_auth.py`, `runtime/transfer/tcp_handshake.py`), so a local process
that merely reaches a port can neither read a node's KV nor write it nor redirect it. The secret
never crosses the wire: each side sends a fresh nonce and a keyed BLAKE2b of both nonces and its
role.

Where it comes from, first found wins:
1. a file named by the operator (`--secret-file`);
2. the environment variable HICACHE_CLUSTER_SECRET;
3. `$XDG_CONFIG_HOME/hicache/cluster-secret` (else `~/.config/hicache/cluster-secret`), created
   with 32 random bytes and mode 0600 when missing — so nodes one user starts on one machine
   agree with no setup, as Erlang nodes do with their cookie. Nodes on several machines need
   the same secret given to each.

A secret file must be a regular file owned by this user and unreadable by others (like an SSH
private key), and a secret, from a file or the environment, at least `MIN_SECRET` (16) bytes once
surrounding whitespace is stripped: a short one can be guessed offline from one recorded
handshake. Anything else is refused with a one-line reason naming where it came from, rather
than trusted; an environment variable that is set but holds only whitespace is refused too,
never passed over for the default file (an empty one counts as unset).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import stat
from pathlib import Path

import attrs

SECRET_ENV = "HICACHE_CLUSTER_SECRET"
MIN_SECRET = 16
MAX_SECRET = 4096
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_KEY_PERSON = b"hicache-cluster"


class UntrustedSecret(ValueError):
    """A secret file that someone other than this user could have written or read, or none."""


def read_secret_file(path: Path) -> bytes:
    """The secret in `path` (surrounding whitespace stripped), refusing a file others can touch."""
    fd = os.open(path, _READ_FLAGS)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedSecret("not a regular file")
        if st.st_uid != os.geteuid():
            raise UntrustedSecret(f"owned by uid {st.st_uid}, not by this process's uid {os.geteuid()}")
        if st.st_mode & 0o077:
            mode = stat.S_IMODE(st.st_mode)
            raise UntrustedSecret(f"mode {mode:04o} lets others read or change it (need 0600)")
        data = os.read(fd, MAX_SECRET + 1).strip()
    finally:
        os.close(fd)
    return _checked(data, "holds")


def _checked(data: bytes, verb: str) -> bytes:
    if not MIN_SECRET <= len(data) <= MAX_SECRET:
        raise UntrustedSecret(
            f"{verb} {len(data)} bytes besides surrounding whitespace, expected {MIN_SECRET} to "
            f"{MAX_SECRET} (e.g. `head -c 32 /dev/urandom | base64`)"
        )
    return data


def env_secret() -> bytes | None:
    """The secret in HICACHE_CLUSTER_SECRET, None when unset or empty; `UntrustedSecret` naming
    the variable when it holds only whitespace or too few bytes."""
    raw = os.environ.get(SECRET_ENV, "")
    if not raw:
        return None
    try:
        return _checked(raw.strip().encode("utf-8", "surrogateescape"), "holds")
    except UntrustedSecret as exc:
        raise UntrustedSecret(f"{SECRET_ENV}: {exc}") from None


def ensure_secret_file(path: Path) -> bytes:
    """The secret in `path`, created first (random, mode 0600) if there is none. Creation is a
    link of a finished temporary file, so concurrent creators all end with the first one's."""
    with contextlib.suppress(FileNotFoundError):
        return read_secret_file(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, _CREATE_FLAGS, 0o600)
    try:
        try:
            os.fchmod(fd, 0o600)
            data = secrets.token_hex(32).encode() + b"\n"
            while data:
                data = data[os.write(fd, data) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        with contextlib.suppress(FileExistsError):  # another process was first: use its secret
            os.link(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return read_secret_file(path)


def default_path() -> Path:
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "hicache" / "cluster-secret"


def _frame(parts: tuple[bytes, ...]) -> bytes:
    """Parts joined unambiguously (each length-prefixed): no two lists of parts collide."""
    return b"".join(len(p).to_bytes(4, "little") + p for p in parts)


@attrs.frozen(repr=False)
class ClusterSecret:
    """A key derived from the cluster secret, and where the secret came from (for the log)."""

    key: bytes = attrs.field(validator=attrs.validators.min_len(1))
    source: str = attrs.field(default="argument", eq=False)

    @classmethod
    def of(cls, secret: bytes | str, source: str = "argument") -> ClusterSecret:
        raw = secret.encode() if isinstance(secret, str) else bytes(secret)
        if not raw:
            raise ValueError("cluster secret: an empty secret authenticates nothing")
        return cls(hashlib.blake2b(raw, digest_size=32, person=_KEY_PERSON).digest(), source)

    @classmethod
    def load(cls, path: Path | None = None) -> ClusterSecret:
        """The secret from `path`, else the environment, else the default file (created if
        missing). Raises `OSError` or `UntrustedSecret` naming the file when it cannot be used."""
        if path is not None:
            return cls.of(_read(path), str(path))
        env = env_secret()
        if env is not None:
            return cls.of(env, SECRET_ENV)
        path = default_path()
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            return cls.of(ensure_secret_file(path), str(path))
        except UntrustedSecret as exc:
            raise UntrustedSecret(f"{path}: {exc}") from None

    def mac(self, purpose: bytes, *parts: bytes) -> bytes:
        """A 32-byte keyed BLAKE2b of `parts` for `purpose` (at most 16 bytes: BLAKE2b's
        personalisation, so a MAC made for one purpose is never valid for another)."""
        return hashlib.blake2b(_frame(parts), key=self.key, digest_size=32, person=purpose).digest()

    def __repr__(self) -> str:  # never the key itself, in a log or a traceback
        return f"ClusterSecret(source={self.source!r})"


def _read(path: Path) -> bytes:
    try:
        return read_secret_file(path)
    except UntrustedSecret as exc:
        raise UntrustedSecret(f"{path}: {exc}") from None
