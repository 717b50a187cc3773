"""`radixmesh serve <service> [flags]`: run one service of the mesh (see `radixmesh serve <service> -h`)."""
from __future__ import annotations

import importlib
import sys

# service -> "module:function(argv) -> int"; adding one is one line.
SERVICES = {
    "tokenizer": "services.tokenizer.main:main",
    "detokenizer": "services.detokenizer.main:main",
    "scheduler": "services.scheduler.main:main",
    "worker": "services.worker.main:main",
    "gateway": "services.gateway.main:main",
    "kvstore": "services.kvstore.main:main",
    "router": "services.router.main:main",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in SERVICES:
        print(f"usage: radixmesh serve {{{','.join(SERVICES)}}} [flags]\n\n{__doc__}", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module, func = SERVICES[argv[0]].split(":")
    try:
        entry = getattr(importlib.import_module(module), func)
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):  # the service itself is missing, not one of its imports
            print(f"radixmesh serve {argv[0]}: not available in this installation ({module})", file=sys.stderr)
            return 2
        raise
    return int(entry(argv[1:]) or 0)
