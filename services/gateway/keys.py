"""API keys: where they come from and what a valid one looks like.

    keys = keys_from(flag_value, "/etc/radixmesh/api-keys", "RADIXMESH_API_KEY", "--api-key")

A key is what a client sends after `Authorization: Bearer `, so it must be printable ASCII
without spaces, and at least MIN_SECRET_BYTES long (a short key can be guessed; make one with
`openssl rand -hex 32`). The flag and the key file give keys together; the environment
variable is read only when neither is given (as the fleet secrets of services/common/secret_file.py),
so a variable left over in a shell never adds a key to a configured gateway. Errors name the
flag, the file and line, or the variable, never the key itself.
"""
from __future__ import annotations

import os

from services.common.secret_file import MIN_SECRET_BYTES

API_KEY_ENV = "RADIXMESH_API_KEY"
ADMIN_KEY_ENV = "RADIXMESH_ADMIN_API_KEY"


def check_key(key: str, where: str) -> str:
    """`key` when it is usable as a bearer token; else ValueError naming `where`."""
    if not all(0x21 <= ord(c) <= 0x7E for c in key):
        raise ValueError(f"{where}: an API key must be printable ASCII without spaces")
    if len(key) < MIN_SECRET_BYTES:
        raise ValueError(f"{where}: an API key needs at least {MIN_SECRET_BYTES} characters, got {len(key)} "
                         "(make one with: openssl rand -hex 32)")
    return key


def read_key_file(path: str, flag: str) -> list[str]:
    """The keys in `path`: one per line, surrounding whitespace stripped; blank lines and lines
    starting with # skipped. A file without any key is an error (a typo would open the gateway)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag}-file: cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    keys = [check_key(line.strip(), f"{flag}-file {path}, line {i}") for i, line in enumerate(lines, 1)
            if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise ValueError(f"{flag}-file {path} holds no key (one per line; # starts a comment)")
    return keys


def keys_from(value: str | None, path: str | None, env: str, flag: str) -> tuple[str, ...]:
    """Every key the flag `flag` (its value), `flag`-file (a path) or else $`env` (one key or
    several, comma-separated) gives, without duplicates, in order; () when none is configured."""
    keys: list[str] = []
    if value is not None:
        keys.append(check_key(value.strip(), flag))
    if path is not None:
        keys += read_key_file(path, flag)
    if value is None and path is None:
        keys += [check_key(k.strip(), f"${env}") for k in os.environ.get(env, "").split(",") if k.strip()]
    return tuple(dict.fromkeys(keys))
