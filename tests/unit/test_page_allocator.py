"""PageAllocator: alloc/free order, exhaustion, double free, token->page math."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.page_allocator import PageAllocator


def test_initially_all_free_and_handed_out_in_order() -> None:
    a = PageAllocator(num_pages=8, page_size=4)
    assert (a.num_pages, a.page_size, a.num_free) == (8, 4, 8)
    assert all(a.is_free(p) for p in range(8))
    assert a.alloc(3) == [0, 1, 2]
    assert a.num_free == 5
    assert not a.is_free(1) and a.is_free(3)
    a.check_invariants()


def test_alloc_zero_is_empty() -> None:
    a = PageAllocator(4, 1)
    assert a.alloc(0) == []
    assert a.num_free == 4


def test_exhaustion_returns_none_and_changes_nothing() -> None:
    a = PageAllocator(4, 1)
    assert a.alloc(3) == [0, 1, 2]
    assert a.alloc(2) is None
    assert a.num_free == 1
    assert a.alloc(1) == [3]
    assert a.alloc(1) is None
    assert a.num_free == 0
    a.check_invariants()


def test_freed_pages_are_reused_fifo() -> None:
    a = PageAllocator(4, 1)
    pages = a.alloc(4)
    assert pages == [0, 1, 2, 3]
    a.free([2, 0])
    assert a.num_free == 2 and a.is_free(0) and a.is_free(2)
    assert a.alloc(2) == [2, 0]


def test_double_free_raises_and_changes_nothing() -> None:
    a = PageAllocator(4, 1)
    a.alloc(2)
    a.free([0])
    with pytest.raises(ValueError, match="double free"):
        a.free([1, 0])  # page 1 is valid, but the call must be all-or-nothing
    assert not a.is_free(1)
    assert a.num_free == 3
    with pytest.raises(ValueError, match="double free"):
        a.free([1, 1])
    assert not a.is_free(1)
    a.check_invariants()


def test_free_of_never_allocated_page_is_a_double_free() -> None:
    a = PageAllocator(4, 1)
    with pytest.raises(ValueError, match="double free"):
        a.free([3])


@pytest.mark.parametrize("page", [-1, 4, 100])
def test_unknown_page_raises(page: int) -> None:
    a = PageAllocator(4, 1)
    a.alloc(4)
    with pytest.raises(ValueError, match="not a page"):
        a.free([page])
    with pytest.raises(ValueError, match="not a page"):
        a.is_free(page)
    assert a.num_free == 0


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="page_size must be >= 1 token, got 0"):
        PageAllocator(4, 0)
    with pytest.raises(ValueError, match="num_pages must be >= 0, got -1"):
        PageAllocator(-1, 1)
    with pytest.raises(ValueError, match=r"cannot allocate a negative number of pages \(-1\)"):
        PageAllocator(4, 1).alloc(-1)
    with pytest.raises(ValueError, match="n_tokens must be >= 0, got -1"):
        PageAllocator(4, 1).pages_for_tokens(-1)


@pytest.mark.parametrize(("n", "ps", "want"), [(0, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2),
                                               (37, 16, 3), (5, 1, 5)])
def test_pages_for_tokens(n: int, ps: int, want: int) -> None:
    assert PageAllocator(4, ps).pages_for_tokens(n) == want


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=40))
def test_random_alloc_free_keeps_the_books(ops: list[tuple[bool, int]]) -> None:
    a = PageAllocator(10, 2)
    held: list[int] = []
    for is_alloc, n in ops:
        if is_alloc:
            got = a.alloc(n)
            assert (got is None) == (n > 10 - len(held))
            held += got or []
        else:
            a.free(held[:n])
            del held[:n]
        assert len(set(held)) == len(held)
        assert a.num_free + len(held) == 10
        assert not any(a.is_free(p) for p in held)
        a.check_invariants()
