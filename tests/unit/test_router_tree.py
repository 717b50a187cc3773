"""The router's approximate prefix tree: matches per replica, splits, LRU eviction, removal."""
from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from services.router.tree import ApproxTree


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def test_match_is_the_longest_routed_prefix_per_replica():
    tree = ApproxTree(Clock())
    tree.insert("hello world", "a")
    tree.insert("hello there", "b")
    assert tree.match("hello world, again") == {"a": 11, "b": 6}
    assert tree.match("help") == {"a": 3, "b": 3}
    assert tree.match("xyz") == {}
    assert tree.sizes == {"a": 11, "b": 11}
    tree.check()


def test_evict_drops_least_recently_routed_leaves_first():
    tree = ApproxTree(Clock())
    tree.insert("shared-old", "a")
    tree.insert("shared-new", "a")
    assert tree.sizes["a"] == 13  # "shared-" + "old" + "new"
    tree.evict(10)
    assert tree.match("shared-old") == {"a": 7}  # the old leaf went
    assert tree.match("shared-new") == {"a": 10}
    tree.evict(0)
    assert tree.match("shared-new") == {} and tree.sizes["a"] == 0
    tree.check()


def test_eviction_of_one_replica_keeps_the_others_nodes():
    tree = ApproxTree(Clock())
    tree.insert("abcdef", "a")
    tree.insert("abcdef", "b")
    tree.sizes["b"]  # both own the same 6 characters
    tree.evict(5)  # each is over: both lose the leaf
    assert tree.match("abcdef") == {}
    tree.insert("abcdef", "a")
    tree.insert("abcxyz", "b")
    tree.remove_replica("a")
    assert tree.match("abcdef") == {"b": 3}
    assert "a" not in tree.sizes
    tree.check()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.text("ab", max_size=12), st.sampled_from("xyz")), max_size=40), st.integers(0, 20))
def test_invariants_hold_under_random_inserts_and_evictions(ops, limit):
    tree = ApproxTree(Clock())
    for key, replica in ops:
        tree.insert(key, replica)
        assert tree.match(key).get(replica, 0) == len(key)
        tree.check()
    tree.evict(limit)
    tree.check()
    assert all(size <= limit for size in tree.sizes.values())


def test_large_keys_stay_fast():
    rng = random.Random(0)
    tree = ApproxTree()
    systems = ["".join(rng.choice("abcdefgh ") for _ in range(4000)) for _ in range(8)]
    for i in range(400):
        tree.insert(systems[i % 8] + f"question {i}", f"r{i % 2}")
    assert tree.match(systems[3] + "question 3")["r1"] >= 4000
    tree.evict(10_000)
    tree.check()
