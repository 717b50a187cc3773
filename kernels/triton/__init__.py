"""The GPU kernels, in Triton. Each sits beside its torch reference; the tests run them on CPU
tensors under Triton's interpreter (TRITON_INTERPRET=1), so they need no GPU."""

from __future__ import annotations

from typing import Any, Callable


def import_triton(kernel: str, reference: str) -> Any:
    """The triton module, imported on first use (the services import these modules without
    ever launching). RuntimeError naming the kernel, and the torch reference that needs no
    triton, when it is not installed."""
    try:
        import triton
    except ImportError as e:
        raise RuntimeError(f"the {kernel} kernel needs triton (CUDA builds of torch ship it); "
                           f"{reference} needs only torch") from e
    return triton


def jitted(interpret: bool, *sources: Callable[[Any], Any]) -> tuple:
    """Each source(tl) (a function returning the kernel's Python function) decorated by
    triton.jit, compiled (interpret False) or interpreted (True). triton.jit picks one when it
    decorates (triton 3.9 reads triton.knobs.runtime.interpret, i.e. TRITON_INTERPRET, then), so
    the knob is pinned while decorating and each module caches one set per setting: turning the
    interpreter on after something imported triton or the module still takes effect."""
    import triton
    import triton.language as tl

    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = interpret
        return tuple(triton.jit(source(tl)) for source in sources)
