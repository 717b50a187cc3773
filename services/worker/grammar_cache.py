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
from collections import OrderedDict
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
    compile_seconds: list[float] = field(default_factory=list)  # drained by the metrics


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
        backend = self.backend
        key = c.key
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                self.stats.hits += 1
                return True, 0.0
            pending = self._compiling.get(key)
            if pending is None:
                self.stats.misses += 1
                pending = self._compiling[key] = Future()
                owner = True
            else:
                owner = False
        if not owner:
            pending.result()  # raises the owner's error
            return True, 0.0
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
        return False, seconds

    def matcher(self, c: Constraint) -> Matcher:
        """A fresh matcher for `c` (compiling here only when the entry was evicted)."""
        with self._lock:
            compiled = self._entries.get(c.key)
            if compiled is not None:
                self._entries.move_to_end(c.key)
                self.stats.hits += 1
        if compiled is None:
            self.stats.compiles_on_step_thread += 1
            log.warning("grammar compiled on the step thread (evicted before admission)",
                        extra={"key": c.key, "cache_size": self.max_entries})
            self.prepare(c)
            with self._lock:
                compiled = self._entries[c.key]
        return self.backend.matcher(compiled)
