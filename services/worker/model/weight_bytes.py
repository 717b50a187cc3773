"""Resident weight bytes: what a model actually holds for its weights, counted once each.

Counted: every parameter and buffer not on the meta device (by storage, so a tied LM head
and its embedding count once), the oneDNN-prepacked copies of the linears (`Linear.packed`,
a second copy beside the dense weight), and the quantized blocks (`Linear.quant`,
`QuantEmbedding.quant`: a tied head shares its embedding's blocks, counted once; an FP8 weight,
`fp8_weights.Fp8Weight`, counts its N*K bytes and N float32 scales: `nbytes` on every format).
Not counted: the rope tables (derived, float32 in every format).
"""
from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from services.worker.model.linear import Linear
from services.worker.model.quant_embedding import QuantEmbedding


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes of dense parameters (non-meta), prepacked copies and quantized blocks held by model."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.is_meta:
            continue
        key = p.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += p.untyped_storage().nbytes()
    quants: dict[int, object] = {}
    for m in model.modules():
        if isinstance(m, Linear) and m.packed is not None:
            total += _packed_bytes(m.packed)
        q = getattr(m, "quant", None) if isinstance(m, (Linear, QuantEmbedding)) else None
        if q is not None:
            quants[id(q)] = q
    return total + sum(q.nbytes for q in quants.values())


def _packed_bytes(packed: torch.Tensor) -> int:
    """An opaque oneDNN tensor reports its logical size; its layout pads at most a little."""
    return packed.numel() * packed.element_size()


def weight_formats(model: nn.Module) -> str:
    """How the linears and the embedding hold their weights, e.g. "embedding Q8_0, 120 linears
    Q4_1 only" or "121 linears dense bfloat16 + Q4_1 for small steps"."""
    counts: Counter[str] = Counter()
    for m in model.modules():
        if isinstance(m, Linear):
            dense = f"dense {str(m.weight.dtype).removeprefix('torch.')}"
            if m.quant_only:
                counts[f"{m.quant.qtype} only"] += 1
            elif m.quant is not None:
                counts[f"{dense} + {m.quant.qtype} for small steps"] += 1
            else:
                counts[dense] += 1
    parts = [f"{n} linears {kind}" for kind, n in sorted(counts.items(), key=lambda kv: -kv[1])]
    embed = getattr(model, "embed_tokens", None)
    if isinstance(embed, QuantEmbedding):
        parts.insert(0, f"embedding {embed.quant.qtype} only")
    return ", ".join(parts)


def format_bytes(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
