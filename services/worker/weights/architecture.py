"""A checkpoint read from disk must describe the serving model's architecture, not just fit its shapes.

Shapes catch most mismatches (staging.py); this catches the ones they cannot: another rope
base or scaling, norm epsilon, window, soft-caps, routing. Fields that do not change the math
of the weights (the served name, stop ids, the context cap the worker applies) may differ.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from services.worker.model.config import ModelConfig
from services.worker.weights.errors import WeightUpdateError

# Not part of the architecture: naming, tokenizer ids, and the context (the worker caps it).
_IGNORED = frozenset({"name", "bos_token_id", "eos_token_ids", "max_position_embeddings"})


def check_same_architecture(serving: ModelConfig, new: ModelConfig, where: str) -> None:
    """Raise WeightUpdateError listing every architecture field where `new` differs from `serving`."""
    diffs = [f"{f.name}: serving {getattr(serving, f.name)!r}, {where} {getattr(new, f.name)!r}"
             for f in dataclasses.fields(ModelConfig)
             if f.name not in _IGNORED and not _same(getattr(serving, f.name), getattr(new, f.name))]
    if diffs:
        raise WeightUpdateError(f"{where} is not the serving model's architecture: " + "; ".join(diffs))


def _same(a: Any, b: Any) -> bool:
    """Equal, floats within float32 rounding (a GGUF stores them as float32, config.json as decimals)."""
    if isinstance(a, float) and isinstance(b, (int, float)) and not isinstance(b, bool):
        return math.isclose(a, b, rel_tol=1e-6)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b
