"""RadixCache with a host tier: random serves, evictions, loads and store inserts keep
every invariant (check_invariants: each node's pages in exactly one tier, tiers only go
down the tree, per-tier counts and leaf sets exact) and allocator accounting sums hold."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.scheduler.page_allocator import PageAllocator
from services.scheduler.radix_cache import RadixCache
from services.step.contract import DEVICE, HOST, STORE

ops_st = st.lists(st.one_of(
    st.tuples(st.just("serve"), st.integers(0, 3), st.lists(st.integers(1, 4), max_size=10), st.booleans()),
    st.tuples(st.just("evict"), st.integers(1, 12)),
    st.tuples(st.just("evict_host"), st.integers(1, 12)),
    st.tuples(st.just("store"), st.integers(0, 3), st.integers(1, 4)),
), max_size=40)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops_st, page_size=st.sampled_from([1, 2]), dev=st.integers(16, 40), host=st.integers(0, 30),
       write_back=st.booleans())
def test_tiers_keep_invariants_and_accounting(ops, page_size, dev, host, write_back):
    a = PageAllocator(dev, page_size)
    h = PageAllocator(host, page_size) if host else None
    c = RadixCache(a, page_size, host_allocator=h, write_back=write_back,
                   keys_for=lambda node: [b"k" * 32] * len(node.pages))
    prefixes = [[1, 2, 3, 4, 1, 2], [2, 2, 2, 2], [3, 1, 3, 1, 3, 1, 3, 1], []]
    for op in ops:
        if op[0] == "serve":  # match, load what is on host (or recompute it), alloc the rest, insert
            _, p, own, load = op
            tokens = prefixes[p] + own
            m = c.match_prefix(tokens)
            if m.host_nodes and load:
                need = m.host_tokens // page_size
                c.inc_lock(m.host_nodes[-1])
                if a.num_free < need:
                    c.evict(need - a.num_free)
                got = a.alloc(need)
                c.dec_lock(m.host_nodes[-1])
                if got is not None:
                    at = 0
                    for node in m.host_nodes:
                        c.promote(node, got[at:at + len(node.pages)])
                        at += len(node.pages)
                    m = c.match_prefix(tokens)
            c.inc_lock(m.node)
            want = a.pages_for_tokens(len(tokens)) - len(m.pages)
            if a.num_free < want:
                c.evict(want - a.num_free)
            new = a.alloc(want)
            if new is not None:
                table = m.pages + new
                already = c.insert(tokens, table)
                a.free(table[len(m.pages):already // page_size] + table[len(tokens) // page_size:])
            c.dec_lock(m.node)
        elif op[0] == "evict":
            before = c.evictable_pages
            assert c.evict(op[1]) == min(op[1], before)
        elif op[0] == "evict_host" and h is not None:
            before = c.evictable_host_pages
            assert c.evict_host(op[1]) == min(op[1], before)
        elif op[0] == "store" and h is not None:  # pages arriving from the store under a cached prefix
            _, p, n = op
            tokens = prefixes[p] + [4] * (n * page_size)
            m = c.match_prefix(tokens)
            first = (m.num_tokens + m.host_tokens) // page_size
            pages = h.alloc(min(n, h.num_free))
            if pages:
                c.insert_host(tokens, pages, first)
        c.check_invariants()
        a.check_invariants()
        assert a.num_free + c.cached_pages == dev  # nothing is locked between ops
        if h is not None:
            h.check_invariants()
            assert h.num_free + c.host_pages == host
        else:
            assert c.host_pages == 0
        for copy in c.copies:  # data moves are well formed
            assert copy.src_tier in (DEVICE, HOST) and copy.dst_tier in (DEVICE, HOST, STORE)
            assert len(copy.src_pages) == (len(copy.dst_pages) if copy.dst_tier != STORE else len(copy.keys))
        c.copies.clear()
