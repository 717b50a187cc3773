"""Radix prefix cache (RadixAttention) over paged KV: token prefixes -> KV pages.

A compressed trie per namespace (LoRA adapter, weights version: anything that
changes the KV must change the namespace, or requests would read another
model's state). Each edge holds a run of token ids and the pages holding their
KV, always whole pages: with page_size > 1 every key length is a multiple of
page_size and nodes only split at page boundaries.

Ownership: pages in the tree belong to the tree until `evict`/`reset` returns
them to the allocator. A request that matched a prefix uses the tree's pages
and pins them with `inc_lock`; its own newly allocated pages are private until
`insert` hands the uncached suffix over to the tree.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Optional, Sequence

from services.scheduler.page_allocator import PageAllocator

_node_ids = itertools.count()


@dataclass(eq=False)
class TreeNode:
    key: tuple[int, ...] = ()  # token ids on the edge from parent to this node
    pages: list[int] = field(default_factory=list)  # len(key) // page_size pages
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict)  # by first page of key
    parent: Optional[TreeNode] = None  # None only for a namespace root
    lock_ref: int = 0  # requests using this node (or a descendant); never evicted while > 0
    last_access: float = 0.0  # logical clock of the last match/insert through this node
    namespace: str = ""
    id: int = field(default_factory=lambda: next(_node_ids))  # eviction tie-break only


@dataclass
class MatchResult:
    pages: list[int]  # the tree's pages for tokens[:num_tokens]; owned by the tree
    num_tokens: int  # a multiple of page_size
    node: TreeNode  # deepest matched node (the namespace root when nothing matched)


class RadixCache:
    """Prefix index over KV pages. All methods are synchronous and not thread-safe."""

    def __init__(self, allocator: PageAllocator, page_size: int, disable: bool = False) -> None:
        if page_size != allocator.page_size:
            raise ValueError(
                f"page_size {page_size} differs from the allocator's page_size {allocator.page_size}"
            )
        self.allocator = allocator
        self.page_size = page_size
        self.disable = disable
        self._roots: dict[str, TreeNode] = {}
        self._leaves: set[TreeNode] = set()  # non-root nodes without children
        self._clock = 0.0
        self._cached_pages = 0
        self._locked_pages = 0

    # -- lookups -------------------------------------------------------------

    def match_prefix(self, tokens: Sequence[int], namespace: str = "") -> MatchResult:
        """Longest cached prefix of `tokens` in `namespace`, in whole pages.

        Changes: refreshes last_access along the matched path, and splits a node
        when the match ends inside it (so `node` covers exactly the match). Owns
        nothing new; lock `node` before relying on the pages across an evict.
        """
        root = self._root(namespace)
        if self.disable:
            return MatchResult(pages=[], num_tokens=0, node=root)
        node, pos, pages = self._walk(tuple(tokens), root, self._tick())
        return MatchResult(pages=pages, num_tokens=pos, node=node)

    def insert(self, tokens: Sequence[int], pages: list[int], namespace: str = "") -> int:
        """Cache `tokens` (truncated to whole pages) whose KV is in `pages`
        (pages[i] holds tokens[i*ps:(i+1)*ps]).

        Returns the number of leading tokens that were already cached. Ownership
        after the call: pages for the uncached suffix belong to the tree; pages
        for the first `returned // ps` pages stay the caller's (free those that are
        its own duplicates, not the tree's pages it got from match_prefix); pages
        past the truncated length (a partial last page) stay the caller's.
        With disable=True nothing is cached and 0 is returned, but ownership is the
        same: the tree takes the suffix pages and frees them at once.
        """
        ps = self.page_size
        n = len(tokens) // ps * ps
        if len(pages) < n // ps:
            raise ValueError(f"{len(pages)} pages cannot hold {n} tokens at page_size {ps}")
        if self.disable:
            self.allocator.free(list(pages[: n // ps]))
            return 0
        key = tuple(tokens[:n])
        node, pos, _ = self._walk(key, self._root(namespace), self._tick())
        if pos < n:
            leaf = TreeNode(key=key[pos:], pages=list(pages[pos // ps : n // ps]), parent=node,
                            last_access=self._clock, namespace=namespace)
            node.children[leaf.key[:ps]] = leaf
            self._leaves.discard(node)
            self._leaves.add(leaf)
            self._cached_pages += len(leaf.pages)
        return pos

    # -- locking ---------------------------------------------------------------

    def inc_lock(self, node: TreeNode) -> None:
        """Pin `node` and its ancestors (+1 lock_ref each; a root is a no-op)."""
        while node.parent is not None:
            if node.lock_ref == 0:
                self._locked_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def dec_lock(self, node: TreeNode) -> None:
        """Undo one inc_lock(node). Raises ValueError, changing nothing, if the
        node is not locked (ancestors' counts are >= the node's)."""
        if node.parent is not None and node.lock_ref <= 0:
            raise ValueError(f"dec_lock on an unlocked node (lock_ref {node.lock_ref})")
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._locked_pages -= len(node.pages)
            node = node.parent

    # -- eviction ------------------------------------------------------------

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` tree pages to the allocator, least recently used
        unlocked leaves first across all namespaces; a parent becomes a candidate
        once its children are gone. A leaf is trimmed from its tail when fewer
        than all of its pages are needed, so exactly min(num_pages,
        evictable_pages) pages are freed. Returns the number freed."""
        heap = [(n.last_access, n.id, n) for n in self._leaves if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            take = min(len(node.pages), num_pages - freed)
            if take < len(node.pages):  # keep the node's head: it may still be a hit
                self.allocator.free(node.pages[-take:])
                del node.pages[-take:]
                node.key = node.key[: len(node.pages) * self.page_size]
            else:
                self.allocator.free(node.pages)
                parent = node.parent
                assert parent is not None
                del parent.children[node.key[: self.page_size]]
                self._leaves.discard(node)
                node.parent = None
                if not parent.children and parent.parent is not None:
                    self._leaves.add(parent)
                    if parent.lock_ref == 0:
                        heapq.heappush(heap, (parent.last_access, parent.id, parent))
            freed += take
        self._cached_pages -= freed
        return freed

    def reset(self) -> None:
        """Flush: free every tree page and drop all namespaces. Raises
        RuntimeError, changing nothing, while any node is locked."""
        if self._locked_pages:  # every non-root node holds >= 1 page
            raise RuntimeError("reset() while requests hold locks on the radix cache")
        pages = [p for node in self._nodes() for p in node.pages]
        self.allocator.free(pages)
        self._roots.clear()
        self._leaves.clear()
        self._cached_pages = 0

    # -- accounting ------------------------------------------------------------

    @property
    def cached_pages(self) -> int:
        """Pages owned by the tree."""
        return self._cached_pages

    @property
    def evictable_pages(self) -> int:
        """Pages in nodes with lock_ref == 0 (all reachable by repeated evict)."""
        return self._cached_pages - self._locked_pages

    @property
    def locked_pages(self) -> int:
        """Pages in nodes with lock_ref > 0."""
        return self._locked_pages

    def check_invariants(self) -> None:
        """Raise AssertionError describing the first broken invariant."""
        ps = self.page_size
        owned: set[int] = set()
        cached = locked = 0
        leaves: set[TreeNode] = set()
        for ns, root in self._roots.items():
            assert root.parent is None and not root.key and not root.pages, f"bad root for {ns!r}"
            assert root.lock_ref == 0, f"root of {ns!r} has lock_ref {root.lock_ref}"
            stack = [root]
            while stack:
                node = stack.pop()
                for first, child in node.children.items():
                    where = f"node {child.id} (ns {ns!r}, key {child.key[:8]}...)"
                    assert child.parent is node, f"{where}: wrong parent"
                    assert child.namespace == ns, f"{where}: namespace {child.namespace!r}"
                    assert child.key and len(child.key) % ps == 0, f"{where}: key length {len(child.key)}"
                    assert child.key[:ps] == first, f"{where}: indexed under {first}"
                    assert len(child.pages) == len(child.key) // ps, (
                        f"{where}: {len(child.pages)} pages for {len(child.key)} tokens")
                    assert child.lock_ref >= 0, f"{where}: lock_ref {child.lock_ref}"
                    assert node.parent is None or node.lock_ref >= child.lock_ref, (
                        f"{where}: lock_ref {child.lock_ref} > parent's {node.lock_ref}")
                    for p in child.pages:
                        assert p not in owned, f"{where}: page {p} owned twice"
                        assert not self.allocator.is_free(p), f"{where}: page {p} is free"
                        owned.add(p)
                    cached += len(child.pages)
                    locked += len(child.pages) if child.lock_ref else 0
                    if not child.children:
                        leaves.add(child)
                    stack.append(child)
        assert cached == self._cached_pages, f"cached_pages {self._cached_pages} != {cached} in tree"
        assert locked == self._locked_pages, f"locked_pages {self._locked_pages} != {locked} in tree"
        assert leaves == self._leaves, "leaf set out of date"

    # -- internals -------------------------------------------------------------

    def _tick(self) -> float:
        self._clock += 1.0
        return self._clock

    def _root(self, namespace: str) -> TreeNode:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = TreeNode(namespace=namespace)
        return root

    def _nodes(self) -> list[TreeNode]:
        out: list[TreeNode] = []
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def _walk(self, key: tuple[int, ...], node: TreeNode, now: float) -> tuple[TreeNode, int, list[int]]:
        """Follow `key` from `node` as far as whole pages match, splitting the
        last node if the match ends inside it and stamping `now` on the path.
        Returns (deepest matched node, tokens matched, their pages)."""
        ps = self.page_size
        pos, pages = 0, []
        node.last_access = now
        while len(key) - pos >= ps:
            child = node.children.get(key[pos : pos + ps])
            if child is None:
                break
            common = ps  # the first page matched through the dict lookup
            limit = min(len(child.key), len(key) - pos)
            while common < limit and child.key[common] == key[pos + common]:
                common += 1
            common = common // ps * ps
            if common < len(child.key):
                child = self._split(child, common)
            child.last_access = now
            pages.extend(child.pages)
            pos += common
            node = child
            if common < limit:
                break
        return node, pos, pages

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Cut `child`'s edge after `at` tokens (a page boundary). The original
        object keeps the tail so MatchResult.node handles stay valid; the new
        head inherits lock_ref (every lock through the tail passes through it)."""
        ps = self.page_size
        parent = child.parent
        assert parent is not None and 0 < at < len(child.key) and at % ps == 0
        head = TreeNode(key=child.key[:at], pages=child.pages[: at // ps], parent=parent,
                        lock_ref=child.lock_ref, last_access=child.last_access,
                        namespace=child.namespace)
        parent.children[head.key[:ps]] = head
        child.key = child.key[at:]
        child.pages = child.pages[at // ps :]
        child.parent = head
        head.children[child.key[:ps]] = child
        return head
