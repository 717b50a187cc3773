"""Page keys: the chain is deterministic over prefixes and never collides across namespaces."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.page_hash import KEY_BYTES, KeyNamespace, PageHasher, chain_keys, kv_layout

NS = KeyNamespace(model="smollm2-135m:abc", weights_version="0", adapter="", page_size=4,
                  kv_layout=kv_layout("bfloat16", 30, 3, 64))
IDS = st.lists(st.integers(0, 2**31 - 1), max_size=40)


def test_full_pages_only_and_key_size() -> None:
    h = PageHasher(NS)
    assert h.keys([1, 2, 3]) == []
    keys = h.keys(list(range(11)))
    assert len(keys) == 2 and all(len(k) == KEY_BYTES for k in keys)
    assert len(set(keys)) == 2


def test_incremental_chain_equals_whole_chain() -> None:
    h = PageHasher(NS)
    ids = list(range(100, 124))
    whole = h.keys(ids)
    first = h.keys(ids[:8])
    assert first + h.keys(ids[8:], parent=first[-1]) == whole


def test_a_page_key_depends_on_everything_before_it() -> None:
    h = PageHasher(NS)
    a = h.keys([1, 2, 3, 4, 5, 6, 7, 8])
    b = h.keys([9, 2, 3, 4, 5, 6, 7, 8])  # same second block, different first
    assert a[1] != b[1]


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="page_size must be >= 1, got 0"):
        dataclasses.replace(NS, page_size=0)
    with pytest.raises(ValueError, match="model identity must not be empty"):
        dataclasses.replace(NS, model="")
    with pytest.raises(ValueError, match="token ids must fit in int32"):
        PageHasher(NS).keys([2**31] * 4)
    with pytest.raises(ValueError, match="parent key must be 32 bytes, got 5"):
        chain_keys(b"short", [1, 2, 3, 4], 4)


@settings(max_examples=200, deadline=None)
@given(IDS, IDS)
def test_identical_prefixes_give_identical_keys(a: list[int], b: list[int]) -> None:
    h = PageHasher(NS)
    ka, kb = h.keys(a), h.keys(b)
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    shared_pages = common // NS.page_size
    assert ka[:shared_pages] == kb[:shared_pages]
    # Past the first differing page, no key is shared at the same or any position.
    assert not set(ka[shared_pages:]) & set(kb[shared_pages:])


namespaces = st.builds(
    KeyNamespace,
    model=st.sampled_from(["m", "m2", "mm", "m:1"]),
    weights_version=st.sampled_from(["", "0", "1", "00"]),
    adapter=st.sampled_from(["", "a", "lora-1", "m"]),
    page_size=st.sampled_from([1, 2, 4, 16]),
    kv_layout=st.sampled_from([kv_layout("bfloat16", 2, 1, 4), kv_layout("float32", 2, 1, 4),
                               kv_layout("bfloat16", 3, 1, 4)]),
)


@settings(max_examples=300, deadline=None)
@given(namespaces, namespaces, st.lists(st.integers(0, 50), min_size=16, max_size=32))
def test_different_namespaces_never_collide(n1: KeyNamespace, n2: KeyNamespace, ids: list[int]) -> None:
    k1, k2 = PageHasher(n1).keys(ids), PageHasher(n2).keys(ids)
    if n1 == n2:
        assert k1 == k2
    else:
        assert n1.root() != n2.root()
        assert not set(k1) & set(k2)


def test_field_boundaries_are_unambiguous() -> None:
    a = dataclasses.replace(NS, model="ab", weights_version="c")
    b = dataclasses.replace(NS, model="a", weights_version="bc")
    assert a.root() != b.root()
