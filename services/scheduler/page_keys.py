"""The store's page keys: one PageHasher per adapter namespace, for requests and tree nodes.

A page's key chains over every token before it (services/common/page_hash.py), so a
request extends its own chain as it grows and a tree node's keys come from its path.
With the fleet's secret the keys are HMAC-SHA256: only schedulers holding the same
secret compute (and so can find or overwrite) the same pages in a shared store.
"""
from __future__ import annotations

from services.common.page_hash import KeyNamespace, PageHasher
from services.scheduler.radix_cache import TreeNode, path_tokens
from services.scheduler.request import Request


class PageKeys:
    def __init__(self, page_size: int, model_identity: str, weights_version: str, kv_layout: str,
                 secret: bytes | None = None) -> None:
        self.page_size = page_size
        self._ns = (model_identity, weights_version, kv_layout)
        self._secret = secret
        self._hashers: dict[str, PageHasher] = {}

    def set_weights_version(self, version: str) -> None:
        """A weight update: every key from now on names pages of the new weights, so no page of
        the old ones can match again (in the kvstore they are garbage its LRU drops)."""
        model, _, layout = self._ns
        self._ns = (model, version, layout)
        self._hashers.clear()

    def hasher(self, adapter: str) -> PageHasher:
        h = self._hashers.get(adapter)
        if h is None:
            model, version, layout = self._ns
            h = self._hashers[adapter] = PageHasher(KeyNamespace(
                model=model, weights_version=version, adapter=adapter, page_size=self.page_size,
                kv_layout=layout), self._secret)
        return h

    def request_keys(self, req: Request, n_pages: int) -> list[bytes]:
        """Keys of req.seq's first n_pages pages, extending the request's chain."""
        have = len(req.page_keys)
        if have < n_pages:
            ps = self.page_size
            parent = req.page_keys[-1] if have else None
            req.page_keys.extend(self.hasher(req.namespace).keys(req.seq[have * ps:n_pages * ps], parent=parent))
        return req.page_keys[:n_pages]

    def node_keys(self, node: TreeNode) -> list[bytes]:
        """Keys of a tree node's pages (write-back names what it writes)."""
        keys = self.hasher(node.namespace).keys(path_tokens(node))
        return keys[len(keys) - len(node.pages):]
