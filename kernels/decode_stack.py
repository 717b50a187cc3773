"""A whole small decode step as one C++ call (kernels/cpu/decode_stack.cpp).

The model builds a `DecodeStack` from its own weights once their quantized blocks are
set (LlamaForCausalLM.use_decode_stack); steps of a few pure-decode rows then skip
Python and torch dispatch between the ops. The op-by-op path is the reference: the
logits are bit-identical (tests/unit/test_decode_stack.py).
"""
from __future__ import annotations

from types import ModuleType

from kernels.cpu_build import load_cpu_extension


def load() -> ModuleType | None:
    """The compiled module (class DecodeStack), or None if it cannot be built here."""
    return load_cpu_extension("decode_stack", "decode_stack.cpp")
