"""A request's output constraint, as every stage carries it.

A constraint is a kind and a spec string: a JSON schema, a regular expression, an EBNF grammar,
a JSON list of choices, or an xgrammar structural tag (JSON). The gateway builds it from the
OpenAI fields (`response_format`, `tools`) or the native ones (`regex`, `ebnf`, `choice`,
`structural_tag`); it travels inside SamplingParams. `key` names the compiled grammar: specs
that are JSON are canonicalised first, so two schemas that differ only in key order or spacing
share one compiled grammar.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

JSON_SCHEMA, REGEX, EBNF, CHOICE, STRUCTURAL_TAG = "json_schema", "regex", "ebnf", "choice", "structural_tag"
KINDS = (JSON_SCHEMA, REGEX, EBNF, CHOICE, STRUCTURAL_TAG)
_JSON_KINDS = (JSON_SCHEMA, CHOICE, STRUCTURAL_TAG)
ANY_JSON_OBJECT = '{"type": "object"}'  # response_format {"type": "json_object"}
MAX_SPEC_CHARS = 256 * 1024


@dataclass(frozen=True)
class Constraint:
    kind: str  # one of KINDS
    spec: str

    @property
    def key(self) -> str:
        """The compiled grammar's cache key: a digest of the kind and the canonical spec."""
        return hashlib.sha256(f"{self.kind}\0{canonical_spec(self)}".encode()).hexdigest()[:32]


def canonical_spec(c: Constraint) -> str:
    """JSON specs with sorted keys and no spacing; others as given."""
    if c.kind not in _JSON_KINDS:
        return c.spec
    try:
        return json.dumps(json.loads(c.spec), sort_keys=True, separators=(",", ":"))
    except ValueError:
        return c.spec  # invalid JSON: the backend's check says why


def json_schema(schema: dict | str) -> Constraint:
    return Constraint(JSON_SCHEMA, schema if isinstance(schema, str) else json.dumps(schema))


def choice(options: list[str]) -> Constraint:
    return Constraint(CHOICE, json.dumps(list(options)))
