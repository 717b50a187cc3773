"""The primitives a program appends to its state (`s += ...`): plain text, roles, gen, select.
They are values; radixmesh/lang/state.py executes them against a backend."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


class Seq(tuple):
    """Pieces joined with + ("Q: " + gen("a") + "\n"), appended in order."""

    def __add__(self, other):
        return Seq(tuple(self) + (other,))

    def __radd__(self, other):
        return Seq((other,) + tuple(self))


class _Joins:
    def __add__(self, other):
        return Seq((self, other))

    def __radd__(self, other):
        return Seq((other, self))


@dataclass(frozen=True)
class Gen(_Joins):
    """Generate into variable `name`. With `choices`, it is a select (scored by logprobs)."""
    name: str | None = None
    max_tokens: int = 128
    stop: tuple[str, ...] = ()
    temperature: float = 0.0
    top_p: float = 1.0
    regex: str | None = None
    json_schema: str | None = None  # a JSON string (gen() accepts a dict too)
    ignore_eos: bool = False

    def sampling_params(self) -> dict:
        """SGLang's /generate sampling_params for this call."""
        sp: dict[str, Any] = {"max_new_tokens": self.max_tokens, "temperature": self.temperature}
        if self.top_p != 1.0:
            sp["top_p"] = self.top_p
        if self.stop:
            sp["stop"] = list(self.stop)
        if self.regex is not None:
            sp["regex"] = self.regex
        if self.json_schema is not None:
            sp["json_schema"] = self.json_schema
        if self.ignore_eos:
            sp["ignore_eos"] = True
        return sp


@dataclass(frozen=True)
class Select(_Joins):
    """Append the choice the prompt's logprobs favour (by `method`, radixmesh/lang/choices.py) and
    store it in variable `name`."""
    name: str | None
    choices: tuple[str, ...]
    method: Any = None  # a choices.Method; None: token_length_normalized


@dataclass(frozen=True)
class Role(_Joins):
    """`role`'s turn: the chat template's prefix, the body, its suffix."""
    role: str  # system | user | assistant
    body: tuple = field(default_factory=tuple)


def gen(name: str | None = None, max_tokens: int = 128, stop: str | list[str] | None = None,
        temperature: float = 0.0, regex: str | None = None, json_schema: str | dict | None = None,
        choices: list[str] | None = None, top_p: float = 1.0, ignore_eos: bool = False) -> Gen | Select:
    """A generation call; greedy by default, so a program's text is reproducible."""
    if choices is not None:
        return select(name, choices)
    if regex is not None and json_schema is not None:
        raise ValueError("gen takes one of regex and json_schema")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    schema = json.dumps(json_schema) if isinstance(json_schema, dict) else json_schema
    return Gen(name, max_tokens, stops, temperature, top_p, regex, schema, ignore_eos)


def select(name: str | None = None, choices: list[str] | None = None, method: Any = None) -> Select:
    if not choices:
        raise ValueError("select needs at least one choice")
    return Select(name, tuple(choices), method)


def system(*body) -> Role:
    return Role("system", body)


def user(*body) -> Role:
    return Role("user", body)


def assistant(*body) -> Role:
    return Role("assistant", body)
