"""The GPU kernels, in Triton. Each sits beside its torch reference; the tests run them on CPU
tensors under Triton's interpreter (TRITON_INTERPRET=1), so they need no GPU."""

from __future__ import annotations

from typing import Any


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
