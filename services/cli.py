"""`radixmesh` command line: one entry point, a subcommand per tool."""
from __future__ import annotations

import argparse
import importlib
import sys

from kernels import cpu_isa

# subcommand -> "module:function(argv) -> int"; adding one is one line.
SUBCOMMANDS = {
    "generate": "services.engine.cli:main",
    "serve": "services.launcher.serve:main",
    "up": "services.launcher.up:main",
    "healthcheck": "services.launcher.healthcheck:main",
    "bench": "services.loadgen.cli:main",
    "eval": "services.eval.cli:main",
    "quantize": "services.quantize.cli:main",
    "train-draft": "services.engine.draft_answers:main",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="radixmesh", description="An LLM serving runtime with RadixAttention.")
    parser.add_argument("command", choices=sorted(SUBCOMMANDS), help="what to run")
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        parser.parse_args(argv[:1] or ["--help"])
    try:  # before torch is imported, so RADIXMESH_CPU_ISA=avx2 holds this process and its children
        cpu_isa.apply_to_torch_env()
    except ValueError as exc:
        parser.error(str(exc))
    module, func = SUBCOMMANDS[argv[0]].split(":")
    return int(getattr(importlib.import_module(module), func)(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
