"""RadixCache: exact examples, then a request simulation checked against a flat model."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from services.scheduler.page_allocator import PageAllocator
from services.scheduler.radix_cache import MatchResult, RadixCache, TreeNode


def make(num_pages: int = 32, page_size: int = 1,
         disable: bool = False) -> tuple[PageAllocator, RadixCache]:
    alloc = PageAllocator(num_pages, page_size)
    return alloc, RadixCache(alloc, page_size, disable=disable)


def serve(cache: RadixCache, tokens: list[int], ns: str = "") -> list[int]:
    """One finished request the way the scheduler does it: match, alloc the rest,
    insert, free own duplicates and the partial tail page. Returns its page table."""
    a = cache.allocator
    m = cache.match_prefix(tokens, ns)
    new = a.alloc(a.pages_for_tokens(len(tokens)) - len(m.pages))
    assert new is not None
    table = m.pages + new
    overlap = cache.insert(tokens, table, ns)
    a.free(table[len(m.pages) : overlap // cache.page_size] + table[len(tokens) // cache.page_size :])
    cache.check_invariants()
    return table


def edges(node: TreeNode) -> dict[tuple[int, ...], object]:
    """Tree shape as nested dicts of edge keys."""
    return {c.key: edges(c) for c in node.children.values()}


def test_match_full_partial_none_page_size_1() -> None:
    a, c = make()
    assert c.insert([1, 2, 3, 4], a.alloc(4)) == 0
    m = c.match_prefix([1, 2, 3, 4, 5])
    assert (m.pages, m.num_tokens, m.node.key) == ([0, 1, 2, 3], 4, (1, 2, 3, 4))
    m = c.match_prefix([7, 1])
    assert (m.pages, m.num_tokens, m.node) == ([], 0, c._roots[""])
    m = c.match_prefix([1, 2, 9])  # ends inside the edge: split at 2
    assert (m.pages, m.num_tokens, m.node.key) == ([0, 1], 2, (1, 2))
    assert edges(c._roots[""]) == {(1, 2): {(3, 4): {}}}
    assert c.cached_pages == 4 and a.num_free == 28
    c.check_invariants()


def test_insert_splits_and_returns_overlap() -> None:
    a, c = make()
    serve(c, [1, 2, 3, 4])
    pages = a.alloc(4)
    assert c.insert([1, 2, 5, 6], pages) == 2  # [1, 2] was cached: pages[:2] are still ours
    a.free(pages[:2])
    assert edges(c._roots[""]) == {(1, 2): {(3, 4): {}, (5, 6): {}}}
    assert c.match_prefix([1, 2, 5, 6]).pages == [0, 1] + pages[2:]
    pages = a.alloc(3)
    assert c.insert([1, 2, 5], pages) == 3  # everything already cached: all pages still ours
    a.free(pages)
    assert c.cached_pages == 6 and a.num_free == 26
    c.check_invariants()


def test_page_size_4_alignment() -> None:
    a, c = make(page_size=4)
    toks = list(range(10))
    pages = a.alloc(3)
    assert c.insert(toks, pages) == 0  # only 8 tokens (2 pages) are cached
    assert c.cached_pages == 2 and not a.is_free(pages[2])
    a.free(pages[2:])  # the partial page stayed ours
    assert c.match_prefix(list(range(7))).num_tokens == 4
    assert c.match_prefix(toks + [99]).pages == pages[:2]
    m = c.match_prefix([0, 1, 2, 3, 4, 5, 77, 77])  # diverges inside page 2
    assert (m.num_tokens, m.pages) == (4, pages[:1])
    assert edges(c._roots[""]) == {(0, 1, 2, 3): {(4, 5, 6, 7): {}}}
    serve(c, [0, 1, 2, 3, 4, 5, 8, 8, 9, 9, 9, 9])
    assert edges(c._roots[""]) == {(0, 1, 2, 3): {(4, 5, 6, 7): {}, (4, 5, 8, 8, 9, 9, 9, 9): {}}}
    c.check_invariants()


def test_match_of_37_tokens_with_page_size_16_returns_32() -> None:
    a, c = make(page_size=16)
    serve(c, list(range(48)))
    m = c.match_prefix(list(range(37)))
    assert m.num_tokens == 32 and len(m.pages) == 2


def test_namespaces_are_isolated() -> None:
    a, c = make()
    serve(c, [1, 2, 3], ns="lora-a")
    assert c.match_prefix([1, 2, 3], "lora-b").num_tokens == 0
    assert c.match_prefix([1, 2, 3]).num_tokens == 0
    assert c.insert([1, 2, 3], a.alloc(3), "lora-b") == 0  # not an overlap across namespaces
    assert c.match_prefix([1, 2, 3], "lora-a").pages == [0, 1, 2]
    assert c.match_prefix([1, 2, 3], "lora-b").pages == [3, 4, 5]
    assert c.cached_pages == 6
    c.check_invariants()


def test_lru_eviction_order_is_exact_and_global_across_namespaces() -> None:
    a, c = make()
    serve(c, [1, 2, 3])  # pages 0 1 2
    serve(c, [1, 2, 4])  # page 3 for [4]
    serve(c, [5, 6], "b")  # pages 4 5
    c.match_prefix([1, 2, 3])  # touch: leaf [3] is now the most recent
    # leaves by age: [4] (page 3), b:[5, 6] (pages 4 5), [3] (page 2)
    assert c.evict(1) == 1 and a.is_free(3)
    assert c.evict(1) == 1 and a.is_free(5) and not a.is_free(4)  # trims b's leaf from its tail
    assert c.match_prefix([5, 6], "b").pages == [4]  # refreshes b:[5]: now newest
    assert c.evict(2) == 2 and a.is_free(2) and a.is_free(1)  # [3], then its parent's tail
    assert c.match_prefix([1, 2, 3]).pages == [0]
    assert c.evict(10) == 2 and c.cached_pages == 0 and a.num_free == 32
    assert c.evict(1) == 0
    c.check_invariants()


def test_locked_nodes_are_not_evicted() -> None:
    a, c = make()
    serve(c, [1, 2, 3])
    serve(c, [1, 2, 4])
    m = c.match_prefix([1, 2, 3])
    c.inc_lock(m.node)
    assert (c.locked_pages, c.evictable_pages, c.cached_pages) == (3, 1, 4)
    assert c.evict(4) == 1 and a.is_free(3)
    assert c.match_prefix([1, 2, 3]).pages == [0, 1, 2]
    c.match_prefix([1, 9])  # split inside a locked edge keeps the counts
    assert c.locked_pages == 3
    c.check_invariants()
    c.dec_lock(m.node)
    assert (c.locked_pages, c.evictable_pages) == (0, 3)
    with pytest.raises(ValueError, match=r"dec_lock on an unlocked node \(lock_ref 0\)"):
        c.dec_lock(m.node)
    c.inc_lock(c._roots[""])  # the root: no-op, as for an empty match
    c.dec_lock(c._roots[""])
    assert c.evict(3) == 3 and c.cached_pages == 0
    c.check_invariants()


def test_reset_requires_no_locks_then_frees_everything() -> None:
    a, c = make()
    serve(c, [1, 2, 3])
    serve(c, [4], "x")
    m = c.match_prefix([1, 2])
    c.inc_lock(m.node)
    with pytest.raises(RuntimeError, match=r"reset\(\) while requests hold locks"):
        c.reset()
    assert c.cached_pages == 4
    c.dec_lock(m.node)
    c.reset()
    assert c.cached_pages == 0 and a.num_free == 32
    assert c.match_prefix([1, 2, 3]).num_tokens == 0
    c.check_invariants()


def test_disabled_cache_matches_nothing_and_takes_pages_it_frees() -> None:
    a, c = make(page_size=2, disable=True)
    pages = a.alloc(3)
    assert c.insert([1, 2, 3, 4, 5], pages) == 0
    assert c.match_prefix([1, 2, 3, 4]).num_tokens == 0
    assert c.cached_pages == 0 and a.num_free == 31 and not a.is_free(pages[2])


def test_bad_arguments_and_corruption_are_reported() -> None:
    with pytest.raises(ValueError, match="page_size 4 differs from the allocator's page_size 2"):
        RadixCache(PageAllocator(4, 2), page_size=4)
    a, c = make(page_size=2)
    with pytest.raises(ValueError, match="1 pages cannot hold 4 tokens at page_size 2"):
        c.insert([1, 2, 3, 4], [0])
    serve(c, [1, 2])
    a.free([0])  # behind the tree's back
    with pytest.raises(AssertionError, match="free"):
        c.check_invariants()


# -- simulation ---------------------------------------------------------------

PROMPTS = [(), (0,) * 8, (0,) * 4 + (1,) * 4, (1, 2) * 3, (2,) * 5]
# Shared prompt heads plus random tails from a tiny alphabet: prefixes collide,
# often mid-page.
TOKENS = st.builds(lambda p, tail: list(p) + tail,
                   st.sampled_from(PROMPTS), st.lists(st.integers(0, 2), max_size=10))
NAMESPACES = st.sampled_from(["", "", "lora-1"])
TOTAL = 24


@dataclass
class Req:
    tokens: list[int]
    ns: str
    match: MatchResult  # its lock is held until finish_request
    new_pages: list[int]  # private until insert


class CacheMachine(RuleBasedStateMachine):
    """Requests against the cache, mirrored in a flat model: one entry per cached
    page, keyed (namespace, aligned prefix ending with that page)."""

    @initialize(page_size=st.sampled_from([1, 2, 4]))
    def setup(self, page_size: int) -> None:
        self.ps = page_size
        self.alloc, self.cache = make(TOTAL, page_size)
        self.page: dict[tuple[str, tuple[int, ...]], int] = {}
        self.time: dict[tuple[str, tuple[int, ...]], float] = {}
        self.locks: dict[tuple[str, tuple[int, ...]], int] = {}
        self.clock = 0.0
        self.active: list[Req] = []

    def prefixes(self, ns: str, tokens: list[int], n_pages: int) -> list[tuple[str, tuple[int, ...]]]:
        return [(ns, tuple(tokens[: (j + 1) * self.ps])) for j in range(n_pages)]

    def model_evict(self, k: int) -> list[int]:
        freed = []
        for _ in range(k):
            children = {(ns, p[: -self.ps]) for ns, p in self.page}
            leaves = [e for e in self.page if e not in children and self.locks.get(e, 0) == 0]
            if not leaves:
                break
            oldest = min(leaves, key=self.time.__getitem__)
            assert [self.time[e] for e in leaves].count(self.time[oldest]) == 1, "model LRU tie"
            freed.append(self.page.pop(oldest))
            del self.time[oldest]
        return freed

    def check_evict(self, k: int) -> None:
        want = self.model_evict(k)
        assert self.cache.evict(k) == len(want)
        assert all(self.alloc.is_free(p) for p in want)

    @rule(tokens=TOKENS, ns=NAMESPACES)
    def start_request(self, tokens: list[int], ns: str) -> None:
        m = self.cache.match_prefix(tokens, ns)
        self.clock += 1
        k = 0
        while k * self.ps + self.ps <= len(tokens) and self.prefixes(ns, tokens, k + 1)[-1] in self.page:
            k += 1
        path = self.prefixes(ns, tokens, k)
        assert (m.num_tokens, m.pages) == (k * self.ps, [self.page[e] for e in path])
        for e in path:
            self.time[e] = self.clock
        self.cache.inc_lock(m.node)
        for e in path:
            self.locks[e] = self.locks.get(e, 0) + 1
        need = self.alloc.pages_for_tokens(len(tokens)) - k
        if self.alloc.num_free < need:
            self.check_evict(need - self.alloc.num_free)
        new = self.alloc.alloc(need)
        if new is None:  # rejected: not enough memory even after eviction
            self.cache.dec_lock(m.node)
            for e in path:
                self.locks[e] -= 1
            return
        self.active.append(Req(tokens, ns, m, new))

    @precondition(lambda self: self.active)
    @rule(i=st.integers(0, 7))
    def finish_request(self, i: int) -> None:
        r = self.active.pop(i % len(self.active))
        matched = r.match.pages
        table = matched + r.new_pages
        n_full = len(r.tokens) // self.ps
        overlap = self.cache.insert(r.tokens, table, r.ns)
        self.clock += 1
        entries = self.prefixes(r.ns, r.tokens, n_full)
        cached = sum(e in self.page for e in entries)
        assert overlap == cached * self.ps
        for j, e in enumerate(entries):
            self.page.setdefault(e, table[j])
            self.time[e] = self.clock
        self.alloc.free(table[len(matched) : cached] + table[n_full:])
        self.cache.dec_lock(r.match.node)
        for e in self.prefixes(r.ns, r.tokens, len(matched)):
            self.locks[e] -= 1

    @rule(tokens=TOKENS, ns=NAMESPACES)
    def lookup(self, tokens: list[int], ns: str) -> None:
        m = self.cache.match_prefix(tokens, ns)
        self.clock += 1
        for e in self.prefixes(ns, tokens, len(m.pages)):
            self.time[e] = self.clock

    @rule(k=st.integers(0, 8))
    def evict(self, k: int) -> None:
        self.check_evict(k)

    @rule()
    def reset(self) -> None:
        if self.cache.locked_pages:
            with pytest.raises(RuntimeError, match=r"reset\(\) while requests hold locks"):
                self.cache.reset()
            return
        self.cache.reset()
        self.page.clear()
        self.time.clear()

    @invariant()
    def tree_matches_model(self) -> None:
        if not hasattr(self, "cache"):
            return
        self.cache.check_invariants()
        self.alloc.check_invariants()
        got_page, got_time, got_lock = {}, {}, {}
        for ns, root in self.cache._roots.items():
            stack = [(root, ())]
            while stack:
                node, prefix = stack.pop()
                for j in range(len(node.pages)):
                    e = (ns, prefix + node.key[: (j + 1) * self.ps])
                    got_page[e], got_time[e], got_lock[e] = node.pages[j], node.last_access, node.lock_ref
                stack += [(c, prefix + node.key) for c in node.children.values()]
        assert got_page == self.page, "cached prefixes differ from the model"
        assert got_time == self.time
        assert got_lock == {e: self.locks.get(e, 0) for e in self.page}
        in_use = sum(len(r.new_pages) for r in self.active)
        assert self.alloc.num_free + self.cache.cached_pages + in_use == TOTAL
        assert self.cache.locked_pages == sum(1 for e in self.page if self.locks.get(e, 0) > 0)
        assert all(n >= 0 for n in self.locks.values())


CacheMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None, derandomize=True)
TestCacheMachine = CacheMachine.TestCase
