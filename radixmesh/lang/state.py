"""A program's state: its text so far, its variables, and the executor that runs what `s += ...`
appends, in order, on a thread of its own (so a fork's branches run at once).

`s += x` returns at once; reading `s["name"]`, `s.text()` or joining waits for what was
appended before and raises the first error it met."""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterator

from radixmesh.lang import choices as choice_methods
from radixmesh.lang.ir import Gen, Role, Select


class ProgramState:
    def __init__(self, backend, text: str = "", variables: dict | None = None, stream: bool = False) -> None:
        self.backend = backend
        self._text = text
        self.variables: dict[str, Any] = dict(variables or {})
        self.meta: dict[str, Any] = {}  # per variable: the backend's meta_info (select: the scores)
        self._stream = stream
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="radixmesh-lang")
        self._last: Future | None = None
        self._changed = threading.Condition()
        self._closed = False

    # --- building ------------------------------------------------------------------
    def __iadd__(self, expr) -> "ProgramState":
        self._last = self._pool.submit(self._run, expr)
        return self

    def fork(self, n: int) -> "ForkGroup":
        """n branches that start from this text. The text is prefilled once first (max_new_tokens 0)
        so every branch finds it in the radix cache instead of all of them computing it at once."""
        self.sync()
        if self._text:
            self.backend.prefill(self._text)
        return ForkGroup(self, [ProgramState(self.backend, self._text, self.variables, self._stream)
                                for _ in range(n)])

    # --- reading -------------------------------------------------------------------
    def sync(self) -> None:
        if self._last is not None:
            self._last.result()

    def __getitem__(self, name: str) -> Any:
        self.sync()
        return self.variables[name]

    def get_meta_info(self, name: str) -> Any:
        self.sync()
        return self.meta.get(name)

    def text(self) -> str:
        self.sync()
        return self._text

    def text_iter(self) -> Iterator[str]:
        """The text as it grows (streamed gens arrive piece by piece), until the program ends."""
        sent = 0
        while True:
            with self._changed:
                self._changed.wait_for(lambda: len(self._text) > sent or self._closed, timeout=1.0)
                text, closed = self._text, self._closed
            if len(text) > sent:
                yield text[sent:]
                sent = len(text)
            elif closed:
                self.sync()
                return

    def close(self) -> None:
        """The program appends nothing more (text_iter ends after what is pending)."""
        def mark() -> None:
            with self._changed:
                self._closed = True
                self._changed.notify_all()
        self._pool.submit(mark)

    # --- executing (on the state's thread) -------------------------------------------
    def _append(self, piece: str) -> None:
        with self._changed:
            self._text += piece
            self._changed.notify_all()

    def _run(self, expr) -> None:
        if isinstance(expr, str):
            self._append(expr)
        elif isinstance(expr, (list, tuple)):
            for e in expr:
                self._run(e)
        elif isinstance(expr, Role):
            fmt = self.backend.role_format()
            self._append(fmt.begin(expr.role))
            self._run(list(expr.body))
            self._append(fmt.end(expr.role))
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            self._select(expr)
        else:
            raise TypeError(f"a program appends text, roles, gen or select, not {type(expr).__name__}")

    def _gen(self, g: Gen) -> None:
        start = len(self._text)
        if self._stream:
            meta = None
            for piece, meta in self.backend.generate_stream(self._text, g):
                self._append(piece)
        else:
            out, meta = self.backend.generate(self._text, g)
            self._append(out)
        if g.name:
            self.variables[g.name] = self._text[start:]
            self.meta[g.name] = meta

    def _select(self, sel: Select) -> None:
        method = sel.method or choice_methods.token_length_normalized
        cond, uncond = self.backend.choice_logprobs(self._text, list(sel.choices), method.needs_unconditional)
        best, scores = method(cond, uncond)
        self._append(sel.choices[best])
        if sel.name:
            self.variables[sel.name] = sel.choices[best]
            self.meta[sel.name] = {"method": method.name, "scores": scores, "token_logprobs": cond}


class ForkGroup:
    """The branches of a fork: index or iterate them, append to all with +=, join to wait."""

    def __init__(self, parent: ProgramState, states: list[ProgramState]) -> None:
        self.parent, self.states = parent, states
        self._before = set(parent.variables)

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __iter__(self):
        return iter(self.states)

    def __iadd__(self, expr) -> "ForkGroup":
        for s in self.states:
            s += expr
        return self

    def join(self) -> list[ProgramState]:
        """Waits for every branch; each variable the branches set gets, in the parent, the list of
        the branches' values (in branch order). The parent's text is unchanged."""
        for s in self.states:
            s.sync()
        names = {k for s in self.states for k in s.variables} - self._before
        for name in sorted(names):
            self.parent.variables[name] = [s.variables.get(name) for s in self.states]
        return self.states
