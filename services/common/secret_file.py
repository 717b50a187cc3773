"""Fleet secrets read from files (or, failing that, from an environment variable).

Secrets stay out of argv (`ps` shows every process's flags to every user): a flag
names a file, or the environment carries the value. Surrounding whitespace is
stripped, so `openssl rand -hex 32 > fleet.key` works as written. Errors name the
flag or variable, so a user knows what to fix.

    secret = secret_from("/etc/radixmesh/kv.key", "RADIXMESH_KV_KEY_SECRET", "--kv-key-secret-file")
    token = token_from(path, "RADIXMESH_KVSTORE_AUTH_TOKEN", "--kvstore-auth-token-file")
"""
from __future__ import annotations

import os

MIN_SECRET_BYTES = 16


def read_secret(path: str, source: str) -> bytes:
    """The secret in `path`, whitespace stripped. Raises ValueError (naming `source`,
    the flag) when it cannot be read or is shorter than MIN_SECRET_BYTES."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ValueError(f"{source}: cannot read {path}: {e.strerror or e}") from None
    return _checked(raw.strip(), f"{source} ({path})")


def secret_from(path: str | None, env: str, source: str) -> bytes | None:
    """The secret from the file `path` when given, else from the environment variable
    `env` (the value itself), else None (the feature is off)."""
    if path is not None:
        return read_secret(path, source)
    value = os.environ.get(env, "").strip()
    return _checked(value.encode(), env) if value else None


def token_from(path: str | None, env: str, source: str) -> str | None:
    """A bearer token (as secret_from); it travels in gRPC metadata, so it must be
    printable ASCII without spaces."""
    secret = secret_from(path, env, source)
    if secret is None:
        return None
    if not all(0x21 <= b <= 0x7E for b in secret):
        raise ValueError(f"{source}: a token must be printable ASCII without spaces (e.g. openssl rand -hex 32)")
    return secret.decode("ascii")


def _checked(secret: bytes, what: str) -> bytes:
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{what}: a secret needs at least {MIN_SECRET_BYTES} bytes, got {len(secret)} "
                         "(make one with: openssl rand -hex 32)")
    return secret
