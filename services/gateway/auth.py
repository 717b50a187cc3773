"""Who may call the gateway: API keys, OpenAI style (`Authorization: Bearer KEY`).

Three kinds of route:
  probes  /health, /ready, /metrics: open, unless --probes-need-key (then as user routes)
  admin   /admin/*, model administration (/model_state, /v1/load_lora_adapter,
          /v1/unload_lora_adapter, /init_weights_update_group, /update_weights*, SGLang's
          /*_expert_distribution_record: services/gateway/model_admin.py) and /flush_cache: the
          admin key (--admin-api-key)
  user    everything else, /openapi.json included (it names the served model): a user key
          (--api-key, --api-key-file, $RADIXMESH_API_KEY) or the admin key

  keys configured    user route               admin route
  none               open                     open (as before; loopback by default)
  admin only         open                     admin key; none or wrong 401
  user only          user key; else 401       401 without a valid key, 403 with one: /admin is off
  user and admin     user or admin key; 401   admin key; a user key 403; none or wrong 401

A refusal is OpenAI's envelope: 401 `invalid_request_error` with code missing_api_key or
invalid_api_key (and `WWW-Authenticate: Bearer`), 403 `permission_error`. Keys are kept as
SHA-256 digests and a presented key is compared with every one of them with
hmac.compare_digest, so neither the time an answer takes nor a log line tells anything about
a key; the caller's identity (for rate limits) is its key's digest, never the key.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Iterable

from aiohttp import web

from services.gateway.errors import APIError

log = logging.getLogger(__name__)

PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})
ADMIN_PREFIXES = ("/admin/", "/flush_cache", "/update_weights", "/model_state", "/v1/load_lora_adapter",
                  "/v1/unload_lora_adapter", "/init_weights_update_group", "/start_expert_distribution_record",
                  "/stop_expert_distribution_record", "/dump_expert_distribution_record")
_CHALLENGE = 'Bearer realm="radixmesh"'


def is_admin_path(path: str) -> bool:
    return path == "/admin" or path.startswith(ADMIN_PREFIXES)


def _digest(key: str) -> bytes:
    # surrogatepass: a header value aiohttp could not decode carries lone surrogates; never an error
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def presented_key(request: web.Request) -> str | None:
    """The bearer token of the request's Authorization header, or None."""
    scheme, _, token = request.headers.get("Authorization", "").strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class KeyRing:
    """The configured keys (as digests) and the verdict on one request."""

    def __init__(self, user_keys: Iterable[str] = (), admin_keys: Iterable[str] = (),
                 probes_need_key: bool = False) -> None:
        self._user = [_digest(k) for k in user_keys]
        self._admin = [_digest(k) for k in admin_keys]
        self.probes_need_key = probes_need_key

    @property
    def user_keys(self) -> bool:
        return bool(self._user)

    @property
    def admin_keys(self) -> bool:
        return bool(self._admin)

    def _match(self, key: str | None) -> tuple[str, bytes] | None:
        """("admin" | "user", the key's digest) when `key` is configured. Every digest is compared,
        whatever matched first, so the time taken does not depend on which key (if any) matched."""
        if key is None:
            return None
        digest, found = _digest(key), None
        for kind, digests in (("admin", self._admin), ("user", self._user)):
            for known in digests:
                if hmac.compare_digest(digest, known) and found is None:
                    found = (kind, digest)
        return found

    def caller(self, request: web.Request) -> str | None:
        """Who is calling, for rate limits: "key:<digest hex>" for a valid key, else "addr:<client
        address>" where no key is needed; None for an open probe (never limited). Raises APIError
        401 (no valid key where one is needed) or 403 (a user key on an admin route)."""
        path = request.path
        if path in PROBE_PATHS and not self.probes_need_key:
            return None
        admin = is_admin_path(path)
        needed = (self._admin or self._user) if admin else self._user
        if not needed:
            return f"addr:{request.remote or ''}"
        key = presented_key(request)
        match = self._match(key)
        if match is None:
            raise _refusal(request, "invalid" if key else "missing")
        kind, digest = match
        if admin and kind != "admin":
            why = ("this route needs the admin key (--admin-api-key)" if self._admin else
                   "admin routes are off: the gateway has API keys but no --admin-api-key")
            log.warning("refused", extra={"path": path, "client": request.remote, "reason": "user key on admin"})
            raise APIError(403, why, "permission_error", code="admin_key_required")
        return f"key:{digest.hex()}"



def _refusal(request: web.Request, why: str) -> APIError:
    """401 for a `why` ("missing" | "invalid") key; logged without the key."""
    log.info("refused", extra={"path": request.path, "client": request.remote, "reason": f"{why} api key"})
    if why == "missing":
        message = "missing API key: send it as the header `Authorization: Bearer YOUR_KEY`"
        challenge = _CHALLENGE
    else:
        message = "invalid API key"
        challenge = f'{_CHALLENGE}, error="invalid_token"'
    return APIError(401, message, code=f"{why}_api_key", headers={"WWW-Authenticate": challenge})


KEYS = web.AppKey("radixmesh_gateway_keys", KeyRing)
