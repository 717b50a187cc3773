"""The xgrammar backend: grammars from JSON schemas, regexes, EBNF, choices and structural tags.

JSON is constrained to one compact layout (`{"a": 1, "b": [2, 3]}`: no free whitespace), as
SGLang does by default: a small model cannot wander into endless newlines, and more of the
output is forced, which jump-forward skips. xgrammar's own compile cache is off: the worker's
GrammarCache (services/worker/grammar_cache.py) is the one cache, keyed by Constraint.key.
"""
from __future__ import annotations

import json
import re

import torch
import xgrammar as xgr

from kernels import token_bitmask_cpu
from kernels.triton import grammar_bitmask
from services.common.grammar.backend import GrammarVocab
from services.common.grammar.constraint import CHOICE, EBNF, JSON_SCHEMA, MAX_SPEC_CHARS, REGEX, STRUCTURAL_TAG, Constraint
from services.common.sampling_params import InvalidRequest

_LOCATION = re.compile(r"^\[[\d:.]+\] \S+:\d+: ")  # "[14:30:58] /project/cpp/x.cc:94: " before the reason
_SEPARATORS = (", ", ": ")


class XGrammarMatcher:
    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._m = xgr.GrammarMatcher(compiled)

    def accept_token(self, token_id: int) -> bool:
        return self._m.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def jump_forward_tokens(self) -> list[int]:
        return self._m.find_jump_forward_tokens()

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    @property
    def terminated(self) -> bool:
        return self._m.is_terminated()


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, vocab: GrammarVocab | None = None, threads: int = 1) -> None:
        self._compiler = None
        self.vocab_size = 0
        if vocab is not None:
            info = xgr.TokenizerInfo(vocab.token_bytes, xgr.VocabType.RAW, vocab_size=len(vocab.token_bytes),
                                     stop_token_ids=vocab.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
            self.vocab_size = len(vocab.token_bytes)
            token_bitmask_cpu.load()  # built (or found built) now, off the step thread, not at the first mask

    def check(self, constraint: Constraint) -> None:
        self._grammar(constraint)

    def compile(self, constraint: Constraint) -> xgr.CompiledGrammar:
        if self._compiler is None:
            raise RuntimeError("this grammar backend was built without a vocabulary: it can only check")
        return self._compiler.compile_grammar(self._grammar(constraint))

    def matcher(self, compiled: xgr.CompiledGrammar) -> XGrammarMatcher:
        return XGrammarMatcher(compiled)

    def new_bitmask(self, rows: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(rows, self.vocab_size)  # [rows, ceil(V / 32)] int32, all -1

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        if logits.device.type == "cpu":  # ours: several times faster than xgrammar's CPU kernel
            token_bitmask_cpu.apply_token_bitmask_(logits, bitmask, rows)
            return
        if logits.is_cuda:  # ours, in Triton (kernels/triton/grammar_bitmask.py)
            grammar_bitmask.apply_token_bitmask_(logits, bitmask.to(logits.device, non_blocking=True), rows)
            return
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)

    def compiled_bytes(self, compiled: xgr.CompiledGrammar) -> int:
        return int(compiled.memory_size_bytes)

    # --- constraint -> xgrammar Grammar, with the user-facing error ---------------------
    def _grammar(self, c: Constraint) -> xgr.Grammar:
        if len(c.spec) > MAX_SPEC_CHARS:
            raise InvalidRequest(f"the {c.kind} constraint has {len(c.spec)} characters (limit {MAX_SPEC_CHARS})")
        try:
            return _build(c)
        except InvalidRequest:
            raise
        except (RuntimeError, ValueError, TypeError) as e:
            raise InvalidRequest(f"invalid {c.kind}: {_reason(e)}") from None


def _build(c: Constraint) -> xgr.Grammar:
    if c.kind == JSON_SCHEMA:
        _refuse_what_xgrammar_ignores(c.spec)
        return xgr.Grammar.from_json_schema(c.spec, any_whitespace=False, separators=_SEPARATORS, strict_mode=True)
    if c.kind == REGEX:
        return xgr.Grammar.from_regex(c.spec)
    if c.kind == EBNF:
        return xgr.Grammar.from_ebnf(c.spec)
    if c.kind == CHOICE:
        return xgr.Grammar.from_ebnf(choice_ebnf(c.spec))
    if c.kind == STRUCTURAL_TAG:
        return xgr.Grammar.from_structural_tag(c.spec)
    raise InvalidRequest(f"unknown constraint kind {c.kind!r}")


def _refuse_what_xgrammar_ignores(spec: str) -> None:
    """xgrammar 0.2.9 compiles a string with both `format` and a length bound but drops the
    bound (it prints a warning to stderr): the output could then break the user's schema. Refuse."""
    try:
        schema = json.loads(spec)
    except ValueError:
        return  # xgrammar's own parse error says why

    def walk(node, path: str) -> None:
        if isinstance(node, dict):
            bounded = isinstance(node.get("minLength"), int) or isinstance(node.get("maxLength"), int)
            if isinstance(node.get("format"), str) and bounded:
                raise InvalidRequest(f"invalid json_schema: {path or 'the schema'} combines format "
                                     f"{node['format']!r} with minLength/maxLength, which xgrammar cannot "
                                     "enforce together; use a pattern instead")
            for k, v in node.items():
                walk(v, f"{path}.{k}" if path else k)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}[{i}]")

    walk(schema, "")


def choice_ebnf(spec: str) -> str:
    """A JSON list of strings -> `root ::= "a" | "b"` (JSON string escapes are EBNF's too)."""
    try:
        options = json.loads(spec)
    except ValueError as e:
        raise InvalidRequest(f"choice must be a JSON list of strings: {e}") from None
    if not isinstance(options, list) or not options or not all(isinstance(o, str) and o for o in options):
        raise InvalidRequest("choice must be a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(o) for o in options)


def _reason(e: Exception) -> str:
    return _LOCATION.sub("", str(e).strip().splitlines()[0] if str(e).strip() else repr(e))
