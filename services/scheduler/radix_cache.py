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

Tiers (HiCache): with a host allocator, each node's pages live in exactly one
tier, DEVICE (the worker's KV pool) or HOST (its host pool), and tiers only go
down the tree (a HOST node's children are HOST). Evicting a device page demotes
its node to HOST (a KVCopy device -> host) when the host tier has room, else
drops it; evicting from HOST drops host leaves (under write-back first copying
them to the store). A match that continues into HOST nodes reports them so the
caller can load them (`promote`) or recompute them (`insert` over HOST nodes
adopts the caller's freshly computed device pages). Data movement is never done
here: the tree appends KVCopy ops to `copies`, which the scheduler sends to the
worker in order.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from services.scheduler.page_allocator import PageAllocator
from services.step.contract import DEVICE, HOST, STORE, KVCopy

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
    tier: str = DEVICE  # where `pages` live: DEVICE (worker pool) or HOST (host pool)
    backed: bool = False  # the kvstore holds these pages (write-back skips them)


@dataclass
class MatchResult:
    pages: list[int]  # the tree's device pages for tokens[:num_tokens]; owned by the tree
    num_tokens: int  # a multiple of page_size
    node: TreeNode  # deepest matched device node (the namespace root when none matched)
    # The match continued past `node` into host-resident nodes (top-down), covering
    # tokens[num_tokens:num_tokens + host_tokens]: `promote` them or recompute them.
    host_nodes: list[TreeNode] = field(default_factory=list)
    host_tokens: int = 0


class RadixCache:
    """Prefix index over KV pages. All methods are synchronous and not thread-safe."""

    def __init__(self, allocator: PageAllocator, page_size: int, disable: bool = False,
                 host_allocator: PageAllocator | None = None, write_back: bool = False,
                 keys_for: Callable[[TreeNode], list[bytes]] | None = None) -> None:
        """host_allocator: the host tier's pages (None: no host tier, eviction drops).
        write_back: pages leaving the tree's lowest tier are first copied to the
        store, their keys from `keys_for(node)` (required then)."""
        for a in (allocator, host_allocator):
            if a is not None and page_size != a.page_size:
                raise ValueError(f"page_size {page_size} differs from the allocator's page_size {a.page_size}")
        if write_back and keys_for is None:
            raise ValueError("write_back needs keys_for to name the pages it writes")
        self.allocator = allocator
        self.host = host_allocator
        self.allocators = {DEVICE: allocator, HOST: host_allocator}
        self.page_size = page_size
        self.disable = disable
        self.write_back = write_back
        self.keys_for = keys_for
        self.copies: list[KVCopy] = []  # data moves decided here, for the worker, in order
        self.counters = {"demoted": 0, "promoted": 0, "dropped_device": 0, "dropped_host": 0,
                         "written_back": 0}
        self._roots: dict[str, TreeNode] = {}
        self._leaves: set[TreeNode] = set()  # non-root nodes without children
        self._dleaves: set[TreeNode] = set()  # device nodes without device children
        self._clock = 0.0
        self._pages = {DEVICE: 0, HOST: 0}
        self._locked = {DEVICE: 0, HOST: 0}

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
        path, _ = self._walk(tuple(tokens), root, self._tick())
        hit = MatchResult(pages=[], num_tokens=0, node=root)
        for node in path:
            if node.tier == DEVICE:
                hit.pages.extend(node.pages)
                hit.num_tokens += len(node.key)
                hit.node = node
            else:
                hit.host_nodes.append(node)
                hit.host_tokens += len(node.key)
        return hit

    def insert(self, tokens: Sequence[int], pages: list[int], namespace: str = "") -> int:
        """Cache `tokens` (truncated to whole pages) whose KV is in `pages`
        (pages[i] holds tokens[i*ps:(i+1)*ps]).

        Returns the number of leading tokens that were already cached on device.
        Ownership after the call: pages for the rest belong to the tree (host-
        resident nodes on the path adopt the caller's pages, their host pages are
        freed); pages for the first `returned // ps` pages stay the caller's (free
        those that are its own duplicates, not the tree's pages it got from
        match_prefix); pages past the truncated length (a partial last page) stay
        the caller's.
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
        root = self._root(namespace)
        path, pos = self._walk(key, root, self._tick())
        on_device, at = 0, 0
        for node in path:
            if node.tier == DEVICE:
                on_device = at + len(node.key)
            else:  # recomputed: the fresh device pages replace the host copy
                self._retier(node, DEVICE, list(pages[at // ps : (at + len(node.key)) // ps]), free_old=True)
            at += len(node.key)
        if pos < n:
            node = path[-1] if path else root
            leaf = TreeNode(key=key[pos:], pages=list(pages[pos // ps : n // ps]), parent=node,
                            last_access=self._clock, namespace=namespace)
            self._attach(leaf)
        return on_device

    def insert_host(self, tokens: Sequence[int], host_pages: list[int], first_page: int,
                    namespace: str = "", backed: bool = True) -> int:
        """Cache host-resident pages for tokens[first_page*ps : first_page*ps +
        len(host_pages)*ps] (loaded from the store) under the cached prefix
        tokens[:first_page*ps]. Pages the tree already has, and all of them when
        the tree no longer holds that whole prefix, are freed to the host
        allocator. Returns the number of host pages the tree took."""
        ps, host = self.page_size, self.host
        assert host is not None, "insert_host without a host tier"
        end = (first_page + len(host_pages)) * ps
        key = tuple(tokens[:end])
        if self.disable or len(key) < end:
            host.free(list(host_pages))
            return 0
        root = self._root(namespace)
        path, pos = self._walk(key, root, self._tick())
        if pos < first_page * ps or pos == end:
            host.free(list(host_pages))
            return 0
        skip = pos // ps - first_page
        host.free(list(host_pages[:skip]))
        node = path[-1] if path else root
        leaf = TreeNode(key=key[pos:], pages=list(host_pages[skip:]), parent=node, last_access=self._clock,
                        namespace=namespace, tier=HOST, backed=backed)
        self._attach(leaf)
        return len(leaf.pages)

    def promote(self, node: TreeNode, device_pages: list[int]) -> None:
        """Load a host-resident node into `device_pages` (taken by the tree): a
        KVCopy host -> device, and its host pages are freed. Its parent must be on
        device (promote a match's host_nodes top-down)."""
        assert node.tier == HOST and len(device_pages) == len(node.pages)
        assert node.parent is not None and node.parent.tier == DEVICE, "promote top-down"
        self.copies.append(KVCopy(HOST, DEVICE, list(node.pages), list(device_pages)))
        self._retier(node, DEVICE, list(device_pages), free_old=True)
        self.counters["promoted"] += len(device_pages)

    # -- locking ---------------------------------------------------------------

    def inc_lock(self, node: TreeNode) -> None:
        """Pin `node` and its ancestors (+1 lock_ref each; a root is a no-op)."""
        while node.parent is not None:
            if node.lock_ref == 0:
                self._locked[node.tier] += len(node.pages)
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
                self._locked[node.tier] -= len(node.pages)
            node = node.parent

    # -- eviction ------------------------------------------------------------

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` device pages to the allocator, least recently
        used unlocked device leaves first across all namespaces; a parent becomes
        a candidate once it has no device children. A leaf is split when fewer
        than all of its pages are needed (its tail goes), so exactly
        min(num_pages, evictable_pages) pages are freed. A freed node is demoted
        to the host tier when that has (or can make) room, else dropped with its
        host-resident subtree. Returns the number freed."""
        heap = [(n.last_access, n.id, n) for n in self._dleaves if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            take = min(len(node.pages), num_pages - freed)
            if take < len(node.pages):  # keep the node's head: it may still be a hit
                self._split(node, len(node.key) - take * self.page_size)
            parent = node.parent
            assert parent is not None
            if not self._demote(node):
                self._drop(node)
            freed += take
            if parent in self._dleaves and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    def evict_host(self, num_pages: int) -> int:
        """Free up to `num_pages` host pages: least recently used unlocked host
        leaves, split like `evict`. Under write-back, pages not already in the
        store are first copied there. Returns the number freed."""
        heap = [(n.last_access, n.id, n) for n in self._leaves if n.tier == HOST and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            take = min(len(node.pages), num_pages - freed)
            if take < len(node.pages):
                self._split(node, len(node.key) - take * self.page_size)
            parent = node.parent
            assert parent is not None
            self._drop(node)
            freed += take
            if parent.tier == HOST and parent in self._leaves and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    def reset(self) -> None:
        """Flush: free every tree page (both tiers) and drop all namespaces.
        Raises RuntimeError, changing nothing, while any node is locked."""
        if self._locked[DEVICE] or self._locked[HOST]:  # every non-root node holds >= 1 page
            raise RuntimeError("reset() while requests hold locks on the radix cache")
        for tier in (DEVICE, HOST):
            pages = [p for node in self._nodes() if node.tier == tier for p in node.pages]
            if pages:
                self.allocators[tier].free(pages)
        self._roots.clear()
        self._leaves.clear()
        self._dleaves.clear()
        self._pages = {DEVICE: 0, HOST: 0}

    # -- accounting ------------------------------------------------------------

    @property
    def cached_pages(self) -> int:
        """Device pages owned by the tree."""
        return self._pages[DEVICE]

    @property
    def host_pages(self) -> int:
        """Host pages owned by the tree."""
        return self._pages[HOST]

    @property
    def evictable_pages(self) -> int:
        """Device pages in nodes with lock_ref == 0 (all reachable by repeated evict)."""
        return self._pages[DEVICE] - self._locked[DEVICE]

    @property
    def evictable_host_pages(self) -> int:
        return self._pages[HOST] - self._locked[HOST]

    @property
    def locked_pages(self) -> int:
        """Device pages in nodes with lock_ref > 0."""
        return self._locked[DEVICE]

    def check_invariants(self) -> None:
        """Raise AssertionError describing the first broken invariant."""
        ps = self.page_size
        owned: dict[str, set[int]] = {DEVICE: set(), HOST: set()}
        cached = {DEVICE: 0, HOST: 0}
        locked = {DEVICE: 0, HOST: 0}
        leaves: set[TreeNode] = set()
        dleaves: set[TreeNode] = set()
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
                    tier = child.tier
                    assert tier in (DEVICE, HOST), f"{where}: tier {tier!r}"
                    assert tier == DEVICE or self.host is not None, f"{where}: host node without a host tier"
                    assert not (tier == DEVICE and node.tier == HOST), f"{where}: device node under a host node"
                    for p in child.pages:
                        assert p not in owned[tier], f"{where}: {tier} page {p} owned twice"
                        assert not self.allocators[tier].is_free(p), f"{where}: {tier} page {p} is free"
                        owned[tier].add(p)
                    cached[tier] += len(child.pages)
                    locked[tier] += len(child.pages) if child.lock_ref else 0
                    if not child.children:
                        leaves.add(child)
                    if tier == DEVICE and all(c.tier != DEVICE for c in child.children.values()):
                        dleaves.add(child)
                    stack.append(child)
        assert cached == self._pages, f"pages per tier {self._pages} != {cached} in tree"
        assert locked == self._locked, f"locked pages per tier {self._locked} != {locked} in tree"
        assert leaves == self._leaves, "leaf set out of date"
        assert dleaves == self._dleaves, "device-leaf set out of date"

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

    def _walk(self, key: tuple[int, ...], node: TreeNode, now: float) -> tuple[list[TreeNode], int]:
        """Follow `key` from `node` as far as whole pages match, splitting the
        last node if the match ends inside it and stamping `now` on the path.
        Returns (the matched nodes top-down, tokens matched)."""
        ps = self.page_size
        pos, path = 0, []
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
            path.append(child)
            pos += common
            node = child
            if common < limit:
                break
        return path, pos

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Cut `child`'s edge after `at` tokens (a page boundary). The original
        object keeps the tail so MatchResult.node handles stay valid; the new
        head inherits lock_ref (every lock through the tail passes through it),
        tier and backed."""
        ps = self.page_size
        parent = child.parent
        assert parent is not None and 0 < at < len(child.key) and at % ps == 0
        head = TreeNode(key=child.key[:at], pages=child.pages[: at // ps], parent=parent,
                        lock_ref=child.lock_ref, last_access=child.last_access,
                        namespace=child.namespace, tier=child.tier, backed=child.backed)
        parent.children[head.key[:ps]] = head
        child.key = child.key[at:]
        child.pages = child.pages[at // ps :]
        child.parent = head
        head.children[child.key[:ps]] = child
        self._refresh(head)
        return head

    def _attach(self, leaf: TreeNode) -> None:
        """Link a new childless, unlocked node under leaf.parent and count it."""
        parent = leaf.parent
        assert parent is not None
        parent.children[leaf.key[: self.page_size]] = leaf
        self._pages[leaf.tier] += len(leaf.pages)
        self._refresh(leaf)
        self._refresh(parent)

    def _refresh(self, node: TreeNode) -> None:
        """Recompute node's membership in the leaf and device-leaf sets."""
        if node.parent is None:  # a root, or a node just unlinked
            self._leaves.discard(node)
            self._dleaves.discard(node)
            return
        if node.children:
            self._leaves.discard(node)
        else:
            self._leaves.add(node)
        if node.tier == DEVICE and all(c.tier != DEVICE for c in node.children.values()):
            self._dleaves.add(node)
        else:
            self._dleaves.discard(node)

    def _retier(self, node: TreeNode, tier: str, pages: list[int], free_old: bool) -> None:
        """Move node's pages to `tier` (its new `pages`), fixing counts and sets."""
        if free_old:
            self.allocators[node.tier].free(node.pages)
        self._pages[node.tier] -= len(node.pages)
        self._pages[tier] += len(pages)
        if node.lock_ref:
            self._locked[node.tier] -= len(node.pages)
            self._locked[tier] += len(pages)
        node.tier, node.pages = tier, pages
        self._refresh(node)
        assert node.parent is not None
        self._refresh(node.parent)

    def _demote(self, node: TreeNode) -> bool:
        """Copy an unlocked device leaf's pages to the host tier and free them on
        device. False, changing nothing on device, when the host has no room."""
        host, need = self.host, len(node.pages)
        if host is None:
            return False
        if host.num_free < need:
            self.evict_host(need - host.num_free)
        host_pages = host.alloc(need)
        if host_pages is None:
            return False
        self.copies.append(KVCopy(DEVICE, HOST, list(node.pages), list(host_pages)))
        self._retier(node, HOST, host_pages, free_old=True)
        self.counters["demoted"] += need
        return True

    def _drop(self, node: TreeNode) -> None:
        """Unlink an unlocked node with its (host-resident) subtree and free every
        page; under write-back, pages the store lacks are written there first."""
        parent = node.parent
        assert parent is not None and node.lock_ref == 0
        subtree, stack = [], [node]
        while stack:
            n = stack.pop()
            subtree.append(n)
            stack.extend(n.children.values())
        if self.write_back:  # keys need the intact path: before anything is unlinked
            for n in subtree:
                if not n.backed and n.pages:
                    self.copies.append(KVCopy(n.tier, STORE, list(n.pages), [], self.keys_for(n)))  # type: ignore[misc]
                    self.counters["written_back"] += len(n.pages)
        del parent.children[node.key[: self.page_size]]
        for n in subtree:
            self.allocators[n.tier].free(n.pages)
            self._pages[n.tier] -= len(n.pages)
            self.counters["dropped_device" if n.tier == DEVICE else "dropped_host"] += len(n.pages)
            n.parent = None
            self._refresh(n)
        self._refresh(parent)


def path_tokens(node: TreeNode) -> list[int]:
    """The token ids from the namespace root down to the end of `node`."""
    parts = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return [t for part in reversed(parts) for t in part]
