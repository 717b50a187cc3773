"""A request's KV pages: prefix matching, growth, caching progress, release.

Composes the page allocator and the radix cache; every page is in exactly one
of three places: free in the allocator, owned by the tree (cached), or private
to one running request (in use). `check_invariants` proves it.
"""
from __future__ import annotations

from typing import Callable

from services.scheduler.page_allocator import PageAllocator
from services.scheduler.radix_cache import RadixCache, TreeNode
from services.scheduler.request import Request
from services.step.contract import HOST


def new_radix_cache(num_pages: int, page_size: int, disable_cache: bool, host_pages: int = 0,
                    write_back: bool = False, keys_for: Callable[[TreeNode], list[bytes]] | None = None) -> RadixCache:
    """The device pool's pages and their prefix tree; host_pages > 0 adds a host tier below
    the pool (see radix_cache.py)."""
    host = PageAllocator(host_pages, page_size) if host_pages > 0 and not disable_cache else None
    return RadixCache(PageAllocator(num_pages, page_size), page_size, disable=disable_cache, host_allocator=host,
                      write_back=write_back, keys_for=keys_for)


class KVManager:
    def __init__(self, cache: RadixCache,
                 should_load: Callable[[str, int], bool] = lambda tier, tokens: True,
                 on_cached: Callable[[Request, int, int], None] = lambda req, lo, hi: None):
        """HiCache's hooks: should_load(tier, tokens): load them from that tier rather than
        recompute them?; on_cached(req, lo, hi): pages [lo, hi) of a request were just given to the tree."""
        self.cache, self.page_size = cache, cache.page_size
        self.allocator, self.host_allocator = cache.allocator, cache.host
        self.cache_enabled = not cache.disable
        self.should_load, self.on_cached = should_load, on_cached
        self.host_hit_tokens = 0  # tokens loaded host -> device, for the stats

    # --- capacity -------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def available_pages(self) -> int:
        """Pages a new allocation can get: free ones plus evictable cached ones."""
        return self.allocator.num_free + self.cache.evictable_pages

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    # --- request lifecycle ------------------------------------------------------
    def match(self, req: Request, limit: int | None = None) -> int:
        """Attach the longest cached prefix of req.seq (leaving >= 1 token to run,
        since sampling needs the last token's logits; at most `limit` tokens when given:
        prompt logprobs and embeddings need their positions computed); returns its length."""
        if not self.cache_enabled:
            return 0
        end = req.seq_len - 1 if limit is None else min(req.seq_len - 1, limit)
        hit = self.cache.match_prefix(req.seq[:end], req.namespace)
        if hit.host_nodes and self.should_load(HOST, hit.host_tokens) and self._load(hit.host_nodes):
            self.host_hit_tokens += hit.host_tokens
            hit = self.cache.match_prefix(req.seq[:end], req.namespace)
        self.cache.inc_lock(hit.node)
        req.node, req.pages, req.tree_tokens = hit.node, list(hit.pages), hit.num_tokens
        req.computed = hit.num_tokens
        req.pages_changed = True
        return hit.num_tokens

    def _load(self, host_nodes: list[TreeNode]) -> bool:
        """Bring a match's host-resident nodes onto the device (host -> device
        copies in the next plan). False, nothing changed, when the device is full."""
        need = sum(len(n.pages) for n in host_nodes)
        self.cache.inc_lock(host_nodes[-1])  # eviction must not take what we load, nor its ancestors
        if self.allocator.num_free < need:
            self.cache.evict(need - self.allocator.num_free)
        pages = self.allocator.alloc(need)
        self.cache.dec_lock(host_nodes[-1])
        if pages is None:
            return False
        at = 0
        for node in host_nodes:
            self.cache.promote(node, pages[at:at + len(node.pages)])
            at += len(node.pages)
        return True

    def grow(self, req: Request, upto_tokens: int) -> bool:
        """Make req's pages cover positions [0, upto_tokens); evicts cached pages
        if needed. False (and nothing changed) when memory is short."""
        need = self.pages_for(upto_tokens) - len(req.pages)
        if need <= 0:
            return True
        if self.allocator.num_free < need:
            self.cache.evict(need - self.allocator.num_free)
        pages = self.allocator.alloc(need)
        if pages is None:
            return False
        req.pages.extend(pages)
        return True

    def shrink(self, req: Request, upto_tokens: int) -> None:
        """Free req's private pages past those covering [0, upto_tokens) (a rejected draft's):
        the worker gets the whole page table again at the next step."""
        keep = max(self.pages_for(upto_tokens), self.pages_for(req.tree_tokens))
        if len(req.pages) <= keep:
            return
        self.allocator.free(req.pages[keep:])
        del req.pages[keep:]
        req.sent_pages = min(req.sent_pages, keep)
        req.pages_changed = True

    def cache_progress(self, req: Request) -> None:
        """Hand the computed, page-aligned part of req's KV to the tree so requests
        arriving now can share it (a prefix being prefilled serves others)."""
        if not self.cache_enabled:
            return
        aligned = self._cacheable(req)
        if aligned <= req.tree_tokens:
            return
        self._insert(req, aligned)

    def release(self, req: Request) -> None:
        """The request is done (finished, aborted or retracted): cache what it
        computed, unlock its prefix, and free its private pages."""
        if self.cache_enabled:
            aligned = self._cacheable(req)
            if aligned > req.tree_tokens:
                self._insert(req, aligned)
            private = req.pages[self.pages_for(req.tree_tokens):]
            self.cache.dec_lock(req.node)
        else:
            private = req.pages
        self.allocator.free(private)
        req.pages, req.node, req.tree_tokens = [], None, 0
        req.computed = 0
        req.pages_changed, req.sent_pages = True, 0  # a restart sends its page table afresh

    def _cacheable(self, req: Request) -> int:
        """Tokens of req the tree can key: computed (or planned: the worker runs plans in
        order) and known, whole pages only."""
        return min(req.computed, req.seq_len) // self.page_size * self.page_size

    def _insert(self, req: Request, n_tokens: int) -> None:
        n_pages = n_tokens // self.page_size
        already = self.cache.insert(req.seq[:n_tokens], req.pages[:n_pages], req.namespace)
        fresh_from = max(already // self.page_size, self.pages_for(req.tree_tokens))
        # Pages the tree already had for [tree_tokens, already) are duplicates of
        # ours: free ours and point the request at the tree's copy.
        dup_from, dup_to = self.pages_for(req.tree_tokens), already // self.page_size
        if dup_to > dup_from:
            self.allocator.free(req.pages[dup_from:dup_to])
        hit = self.cache.match_prefix(req.seq[:n_tokens], req.namespace)
        assert hit.num_tokens == n_tokens, (hit.num_tokens, n_tokens)
        self.cache.inc_lock(hit.node)
        self.cache.dec_lock(req.node)
        if dup_to > dup_from:
            req.pages_changed = True
        req.pages[:n_pages] = hit.pages
        req.node, req.tree_tokens = hit.node, n_tokens
        self.on_cached(req, fresh_from, n_pages)

    # --- checks -------------------------------------------------------------------
    def check_invariants(self, running: list[Request], host_inflight: int = 0) -> None:
        """free + cached + private pages == total, with no page in two places;
        on the host tier free + cached + in flight (prefetching) == total."""
        self.cache.check_invariants()
        if self.host_allocator is not None:
            h = self.host_allocator
            h.check_invariants()
            assert h.num_free + self.cache.host_pages + host_inflight == h.num_pages, (
                f"host: free {h.num_free} + cached {self.cache.host_pages} + in flight {host_inflight} "
                f"!= total {h.num_pages}")
        private: list[int] = []
        for req in running:
            private.extend(req.pages[self.pages_for(req.tree_tokens):] if self.cache_enabled else req.pages)
        assert len(private) == len(set(private)), "a private page is held by two requests"
        assert not any(self.allocator.is_free(p) for p in private), "a private page is also free"
        total = self.allocator.num_free + self.cache.cached_pages + len(private)
        assert total == self.num_pages, (
            f"free {self.allocator.num_free} + cached {self.cache.cached_pages} + "
            f"private {len(private)} != total {self.num_pages}")
