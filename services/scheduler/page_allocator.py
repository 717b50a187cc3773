"""KV page allocator: which of the worker's KV pages are free.

Pages are plain ints `0..num_pages-1`; the worker owns the tensors behind them.
The allocator only knows free vs. not free. Who holds a non-free page (the radix
cache or a running request) is the caller's bookkeeping, which is what keeps
`free + cached + in_use == total` checkable from outside.
"""
from __future__ import annotations

from collections import deque


class PageAllocator:
    """Free list of KV pages with O(1) alloc/free per page and double-free checks.

    Pages are handed out first-in first-out: initially in ascending order, then
    freed pages are reused in the order they were freed.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1 token, got {page_size}")
        self.num_pages: int = num_pages
        self.page_size: int = page_size
        self._free_list: deque[int] = deque(range(num_pages))
        self._is_free: bytearray = bytearray(b"\x01") * num_pages

    @property
    def num_free(self) -> int:
        """Number of pages currently free."""
        return len(self._free_list)

    def alloc(self, n: int) -> list[int] | None:
        """Take `n` free pages. Returns them, or None and changes nothing when
        fewer than `n` are free (the caller decides whether to evict and retry)."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > len(self._free_list):
            return None
        pages = [self._free_list.popleft() for _ in range(n)]
        for p in pages:
            self._is_free[p] = 0
        return pages

    def free(self, pages: list[int]) -> None:
        """Return `pages` to the free list.

        All-or-nothing: raises ValueError, changing nothing, if any page is out of
        range, already free, or listed twice.
        """
        seen: set[int] = set()
        for p in pages:
            if not 0 <= p < self.num_pages:
                raise ValueError(f"page {p} is not a page of this pool (0..{self.num_pages - 1})")
            if self._is_free[p] or p in seen:
                raise ValueError(f"double free of page {p}")
            seen.add(p)
        for p in pages:
            self._is_free[p] = 1
        self._free_list.extend(pages)

    def is_free(self, page: int) -> bool:
        """Whether `page` is currently free. Raises ValueError for an unknown page."""
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page {page} is not a page of this pool (0..{self.num_pages - 1})")
        return bool(self._is_free[page])

    def pages_for_tokens(self, n_tokens: int) -> int:
        """Pages needed to hold `n_tokens` tokens: ceil(n_tokens / page_size)."""
        if n_tokens < 0:
            raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
        return -(-n_tokens // self.page_size)

    def check_invariants(self) -> None:
        """Raise AssertionError if the free list and the free flags disagree."""
        assert len(set(self._free_list)) == len(self._free_list), "a page is on the free list twice"
        assert sum(self._is_free) == len(self._free_list), (
            f"{sum(self._is_free)} pages flagged free but {len(self._free_list)} on the free list"
        )
        for p in self._free_list:
            assert self._is_free[p], f"page {p} on the free list but not flagged free"
