"""Ahead-of-time compiles of the Triton kernels for sm_90, which the tests use to check, with no
GPU, that what the interpreter runs as Python also lowers (triton ships ptxas)."""
from __future__ import annotations

from typing import Any


def compile_for_sm90(fn: Any, types: dict[str, str], constexprs: dict[str, Any], cache_dir: Any,
                     options: dict[str, Any] | None = None) -> Any:
    """fn (a triton.jit kernel, compiled mode) built for sm_90: each argument typed by `types`
    ("*bf16", "i64", ...; "i32" when not named), "constexpr" when it is in `constexprs`; the
    compile cache kept in cache_dir (a test's tmp_path). → the compiled kernel (.asm["cubin"])."""
    import triton
    from triton.backends.compiler import GPUTarget

    signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in fn.arg_names}
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    with triton.knobs.cache.scope():
        triton.knobs.cache.dir = str(cache_dir)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
