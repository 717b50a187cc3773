"""Render a model's own Jinja chat template the way Hugging Face transformers does.

Templates come from model files, so they are untrusted code: they run in jinja2's immutable
sandbox. The environment mirrors transformers' (`trim_blocks`, `lstrip_blocks`, loop controls,
a `tojson` that keeps non-ASCII, `raise_exception`, `strftime_now`), so a template renders to the
same string here as with `tokenizer.apply_chat_template(..., tokenize=False)`.
"""
from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from jinja2 import nodes
from jinja2.exceptions import TemplateError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for HF's training masks;
    for serving it renders as its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    # Templates call this to reject conversations they cannot render (e.g. roles out of order).
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson HTML-escapes `<`, `>`, `&` and `'`; tool schemas must reach the model verbatim.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template.

    `render` returns the prompt text; it raises jinja2.TemplateError when the template rejects the
    conversation (via `raise_exception`) and jinja2.sandbox.SecurityError when it tries to escape.
    """

    def __init__(self, source: str) -> None:
        self.source = source
        self._template = _environment().from_string(source)

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, special_tokens: dict[str, str] | None = None,
               **extra: Any) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]).

        `special_tokens` ({"bos_token": ..., "eos_token": ...}) become template variables, as
        transformers passes its special-tokens map; `extra` is passed through (e.g. `documents`,
        `enable_thinking`) and may override them.
        """
        for m in messages:
            if not isinstance(m, dict):
                raise TypeError(f"chat messages must be dicts with 'role' and 'content', got {m!r}")
        variables = {**(special_tokens or {}), **extra}
        return self._template.render(messages=messages, tools=tools,
                                     add_generation_prompt=add_generation_prompt, **variables)
