"""Page keys: a hash chain over page-sized token blocks, seeded with the KV's identity.

    ns = KeyNamespace(model="SmolLM2-135M-Instruct:<file digest>", weights_version="0",
                      adapter="", page_size=16, kv_layout=kv_layout("bfloat16", 30, 3, 64))
    hasher = PageHasher(ns)
    keys = hasher.keys(token_ids)              # one 32-byte key per *full* page
    more = hasher.keys(next_ids, parent=keys[-1])  # continue a chain incrementally

key[i] = blake2b(key[i-1] ‖ int32-LE(token_ids[i*P:(i+1)*P])), key[-1] = the
namespace root. The root hashes every field of the namespace (model identity,
weights version, adapter id, page size, KV dtype and layout, format version),
length-prefixed so that no two different namespaces encode alike; a page is
therefore only ever found under the exact model, weights, adapter and layout
that computed it, and only after the exact same token prefix. A trailing
partial page has no key: only full pages are shared.

Keys are 32 bytes (256 bits): collisions are out of reach even for crafted
prompts. blake2b over a few hundred bytes costs about a microsecond per page.

Keyed chains: with a fleet secret (`PageHasher(ns, secret=...)`), the root and
every link are HMAC-SHA256(secret, "radixmesh-kv" ‖ the same bytes) instead. Keys
then cross a trust boundary (a store shared with, or readable by, others) without
revealing anything: nobody without the secret can compute the key of a prompt to
probe the store for it (was this prefix served?) or to plant a page under it.
Schedulers with different secrets share no key; without one, keys are as above.
"""
from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Sequence

import numpy as np

KEY_BYTES = 32
FORMAT_VERSION = 1  # bump when the chain's definition changes: old keys stop matching
_PERSON = b"radixmesh-kv"  # blake2b personalization: keys never equal other blake2b uses


def kv_layout(dtype: str, num_layers: int, num_kv_heads: int, head_dim: int, latent_dim: int = 0) -> str:
    """The KV layout string of a page [num_layers, 2, page_size, num_kv_heads, head_dim]
    of `dtype` (a torch dtype name such as "bfloat16", or an FP8 one with its scale,
    "float8_e4m3fn*0.25+hadamard": services/kvstore/page_codec.PageSpec.layout); part of the namespace,
    so pages of two KV dtypes never share a key. latent_dim > 0: an MLA latent page
    [num_layers, 1, page_size, 1, head_dim] (K alone, V its first latent_dim columns), named "KV1"
    and by its latent width, so it is never read as an ordinary page of the same numbers."""
    if latent_dim:
        return f"{dtype}:L{num_layers}:KV1:H{num_kv_heads}:D{head_dim}:latent{latent_dim}"
    return f"{dtype}:L{num_layers}:KV2:H{num_kv_heads}:D{head_dim}"


@dataclass(frozen=True)
class KeyNamespace:
    """Everything a page's bytes depend on besides its tokens.

    model: the model's identity (name plus a digest of its file or config);
    weights_version: bumped by a weight update, so every old page stops matching;
    adapter: the LoRA adapter id ("" = the base model); page_size: tokens per
    page; kv_layout: dtype and shape of a page (see `kv_layout`).
    """

    model: str
    weights_version: str
    adapter: str
    page_size: int
    kv_layout: str

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if not self.model:
            raise ValueError("model identity must not be empty")

    def root(self, secret: bytes | None = None) -> bytes:
        """The chain's seed: KEY_BYTES bytes, different for any two namespaces (and,
        keyed, for any two secrets)."""
        fields = []
        for part in (str(FORMAT_VERSION), self.model, self.weights_version, self.adapter,
                     str(self.page_size), self.kv_layout):
            raw = part.encode("utf-8")
            fields += [len(raw).to_bytes(8, "little"), raw]  # length prefix: ("ab","c") != ("a","bc")
        message = b"".join(fields)
        if secret is not None:
            return hmac.digest(secret, _PERSON + message, "sha256")
        return hashlib.blake2b(message, digest_size=KEY_BYTES, person=_PERSON).digest()


def chain_keys(parent: bytes, token_ids: Sequence[int] | np.ndarray, page_size: int,
               secret: bytes | None = None) -> list[bytes]:
    """Keys of the full pages of `token_ids`, chained from `parent`.

    `parent` is the namespace root or the key of the page just before
    token_ids[0]. Returns len(token_ids) // page_size keys. With `secret`, each
    link is HMAC-SHA256(secret, person ‖ parent ‖ block). Raises ValueError for
    ids outside int32 (the wire type of token ids).
    """
    if len(parent) != KEY_BYTES:
        raise ValueError(f"parent key must be {KEY_BYTES} bytes, got {len(parent)}")
    n = len(token_ids) // page_size
    if n == 0:
        return []
    ids = np.asarray(token_ids[: n * page_size], dtype=np.int64)
    if ids.size and (ids.min() < -(2**31) or ids.max() >= 2**31):
        raise ValueError("token ids must fit in int32")
    raw = ids.astype("<i4").tobytes()
    step = page_size * 4
    keys = []
    for i in range(n):
        block = raw[i * step:(i + 1) * step]
        if secret is not None:
            parent = hmac.digest(secret, _PERSON + parent + block, "sha256")
        else:
            h = hashlib.blake2b(parent, digest_size=KEY_BYTES, person=_PERSON)
            h.update(block)
            parent = h.digest()
        keys.append(parent)
    return keys


class PageHasher:
    """Keys for one namespace: `keys(ids)` from the root, or from `parent`; keyed
    (HMAC-SHA256) when given the fleet's secret, else unkeyed blake2b."""

    def __init__(self, namespace: KeyNamespace, secret: bytes | None = None) -> None:
        if secret is not None and not secret:
            raise ValueError("the page-key secret must not be empty (None = unkeyed)")
        self.namespace = namespace
        self.page_size = namespace.page_size
        self._secret = secret
        self.root = namespace.root(secret)

    def keys(self, token_ids: Sequence[int] | np.ndarray, parent: bytes | None = None) -> list[bytes]:
        """One key per full page of token_ids (a trailing partial page has none)."""
        return chain_keys(self.root if parent is None else parent, token_ids, self.page_size, self._secret)
