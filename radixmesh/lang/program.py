"""@function programs: run one, run a batch (its constant prefix prefilled once), stream one."""
from __future__ import annotations

import functools
import inspect
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from radixmesh.lang.ir import Role
from radixmesh.lang.state import ProgramState

_default_backend = None


def set_default_backend(backend) -> None:
    global _default_backend
    _default_backend = backend


def _backend(backend):
    b = backend or _default_backend
    if b is None:
        raise RuntimeError("no backend: pass backend= or call radixmesh.lang.set_default_backend(...)")
    return b


class _StopTrace(Exception):
    pass


class _Unknown:
    """An argument while tracing the constant prefix: any use of it ends the trace."""

    def _stop(self, *a, **k):
        raise _StopTrace

    __str__ = __format__ = __add__ = __radd__ = __getitem__ = __iter__ = __len__ = __bool__ = _stop
    __eq__ = __lt__ = __gt__ = __int__ = __float__ = __getattr__ = _stop
    __hash__ = object.__hash__


class _Tracer:
    """Collects the text a program appends before its first argument-dependent or generated piece."""

    def __init__(self, backend) -> None:
        self.backend, self.text = backend, ""

    def __iadd__(self, expr) -> "_Tracer":
        self._add(expr)
        return self

    def _add(self, expr) -> None:
        if isinstance(expr, str):
            self.text += expr
        elif isinstance(expr, (list, tuple)):
            for e in expr:
                self._add(e)
        elif isinstance(expr, Role):
            fmt = self.backend.role_format()
            self.text += fmt.begin(expr.role)
            self._add(list(expr.body))
            self.text += fmt.end(expr.role)
        else:  # gen, select, an argument: the prefix ends here
            raise _StopTrace

    def __getattr__(self, name):
        raise _StopTrace

    def __getitem__(self, name):
        raise _StopTrace


class Program:
    def __init__(self, fn) -> None:
        self.fn = fn
        self.params = list(inspect.signature(fn).parameters)[1:]
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs) -> ProgramState:
        return self.run(*args, **kwargs)

    def run(self, *args, backend=None, stream: bool = False, **kwargs) -> ProgramState:
        """Runs the program; returns its state (read s["var"], s.text()). With stream=True it returns
        at once and the state's text_iter() yields the text as it is generated."""
        state = ProgramState(_backend(backend), stream=stream)

        def body() -> None:
            try:
                self.fn(state, *args, **kwargs)
            finally:
                state.close()

        if stream:
            threading.Thread(target=body, daemon=True, name="radixmesh-lang-program").start()
        else:
            body()
            state.sync()
        return state

    def constant_prefix(self, backend=None) -> str:
        """The text every run starts with whatever its arguments."""
        tracer = _Tracer(_backend(backend))
        try:
            self.fn(tracer, **{p: _Unknown() for p in self.params})
        except _StopTrace:
            pass
        return tracer.text

    def run_batch(self, batch: list[dict[str, Any]], backend=None, num_threads: int = 16,
                  progress_bar: bool = False) -> list[ProgramState]:
        """Runs the program once per argument dict, num_threads at a time. The constant prefix is
        prefilled once first, so the runs share it instead of all computing it at once."""
        b = _backend(backend)
        prefix = self.constant_prefix(b)
        if prefix and len(batch) > 1:
            b.prefill(prefix)
        bar = None
        if progress_bar:
            from tqdm import tqdm
            bar = tqdm(total=len(batch))

        def one(kwargs: dict) -> ProgramState:
            try:
                return self.run(backend=b, **kwargs)
            finally:
                if bar is not None:
                    bar.update(1)

        with ThreadPoolExecutor(max(1, num_threads)) as pool:
            states = list(pool.map(one, batch))
        if bar is not None:
            bar.close()
        return states


def function(fn) -> Program:
    """Makes `fn(s, ...)` a program: `s += ...` appends, `s["name"]` reads a variable."""
    return Program(fn)

