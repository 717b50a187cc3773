"""A request body's structured-output fields → one Constraint (services/common/grammar).

OpenAI's `response_format` (json_object, json_schema) and the extras `regex`, `ebnf`, `choice`
and `structural_tag` (on /generate inside sampling_params, with `json_schema` as a string, as
SGLang has it). At most one may be given. Whether the grammar compiles is the scheduler's
check (xgrammar's reason comes back as a 400), so this module never imports xgrammar.
"""
from __future__ import annotations

import json
from typing import Any

from services.common.grammar.constraint import (ANY_JSON_OBJECT, EBNF, REGEX, STRUCTURAL_TAG, Constraint,
                                                choice, json_schema)
from services.gateway.errors import invalid

EXTRAS = ("regex", "ebnf", "choice", "structural_tag")


def constraint_of(values: dict[str, Any], json_schema_field: bool = False) -> Constraint | None:
    """values: the body (OpenAI routes) or its sampling_params (/generate, json_schema_field)."""
    found: dict[str, Constraint] = {}
    fmt = values.get("response_format")
    if fmt is not None and fmt["type"] != "text":
        found["response_format"] = _response_format(fmt)
    if json_schema_field and values.get("json_schema") is not None:
        found["json_schema"] = json_schema(values["json_schema"])
    if values.get("regex") is not None:
        found["regex"] = Constraint(REGEX, values["regex"])
    if values.get("ebnf") is not None:
        found["ebnf"] = Constraint(EBNF, values["ebnf"])
    if values.get("choice") is not None:
        found["choice"] = choice(values["choice"])
    tag = values.get("structural_tag")
    if tag is not None:
        found["structural_tag"] = Constraint(STRUCTURAL_TAG, tag if isinstance(tag, str) else json.dumps(tag))
    if len(found) > 1:
        raise invalid(f"give at most one output constraint; got {', '.join(found)}", param=list(found)[1])
    return next(iter(found.values()), None)


def _response_format(fmt: dict) -> Constraint:
    if fmt["type"] == "json_object":
        return json_schema(ANY_JSON_OBJECT)
    spec = fmt.get("json_schema")
    if spec is None:
        raise invalid('response_format {"type": "json_schema"} needs json_schema: {"name": ..., "schema": {...}}',
                      param="response_format.json_schema")
    return json_schema(spec.get("schema") or json.loads(ANY_JSON_OBJECT))
