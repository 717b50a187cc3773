"""Compiled grammars, bounded and shared: the worker's one cache of them.

`prepare(constraint)` compiles off the step thread (the scheduler's grammar queue asks for it
before the request is admitted; services/scheduler/grammar_queue.py); concurrent asks for one
key wait for the same compile. `matcher(constraint)` is what admission uses on the step thread:
a hit normally, a compile there only if the entry was evicted in between (counted). The LRU is
bounded by entries; the backend (and the vocabulary it needs) is built on first use, so a worker
that never sees a constraint never pays for it.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from services.common.grammar.backend import GrammarBackend, Matcher
from services.common.grammar.constraint import Constraint

log = logging.getLogger(__name__)


@dataclass
class GrammarCacheStats:
    hits: int = 0
    misses: int = 0
    compiles_on_step_thread: int = 0
    masked_rows: int = 0  # sampled rows a grammar masked
    jump_forward_tokens: int = 0  # tokens appended without a model step
    compile_seconds: deque = field(default_factory=lambda: deque(maxlen=256))  # the latest compiles' times


class GrammarCache:
    def __init__(self, make_backend: Callable[[], GrammarBackend], max_entries: int = 64) -> None:
        if max_entries < 1:
            raise ValueError(f"grammar cache size must be >= 1, got {max_entries}")
        self._make_backend, self.max_entries = make_backend, max_entries
        self._backend: GrammarBackend | None = None
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, Any] = OrderedDict()  # key -> compiled grammar, oldest first
        self._compiling: dict[str, Future] = {}
        self.stats = GrammarCacheStats()

    @property
    def backend(self) -> GrammarBackend:
        with self._lock:
            if self._backend is None:
                t0 = time.perf_counter()
                self._backend = self._make_backend()
                log.info("grammar backend ready", extra={"backend": self._backend.name,
                                                         "seconds": round(time.perf_counter() - t0, 3)})
            return self._backend

    def __len__(self) -> int:
        return len(self._entries)

    def prepare(self, c: Constraint) -> tuple[bool, float]:
        """Compile `c` unless cached → (was cached, compile seconds). Raises the backend's
        InvalidRequest for a constraint that does not compile."""
        _, cached, seconds = self._get(c)
        return cached, seconds

    def matcher(self, c: Constraint) -> Matcher:
        """A fresh matcher for `c` (compiling here only when the entry was evicted)."""
        with self._lock:
            present = c.key in self._entries
        if not present:
            self.stats.compiles_on_step_thread += 1
            log.warning("grammar compiled on the step thread (evicted before admission)",
                        extra={"key": c.key, "cache_size": self.max_entries})
        compiled, _, _ = self._get(c)
        return self.backend.matcher(compiled)

    def _get(self, c: Constraint) -> tuple[Any, bool, float]:
        """(compiled grammar, was cached, compile seconds); one compile per key at a time."""
        backend = self.backend
        key = c.key
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                self.stats.hits += 1
                return self._entries[key], True, 0.0
            pending = self._compiling.get(key)
            owner = pending is None
            if owner:
                self.stats.misses += 1
                pending = self._compiling[key] = Future()
        if not owner:
            return pending.result(), True, 0.0  # raises the owner's error
        t0 = time.perf_counter()
        try:
            compiled = backend.compile(c)
        except Exception as exc:
            with self._lock:
                del self._compiling[key]
            pending.set_exception(exc)
            raise
        seconds = time.perf_counter() - t0
        with self._lock:
            self._entries[key] = compiled
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
            del self._compiling[key]
            self.stats.compile_seconds.append(seconds)
        pending.set_result(compiled)
        return compiled, False, seconds
