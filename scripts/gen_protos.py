#!/usr/bin/env python
"""Regenerate the Python code of the radixmesh protos (every version: v1, v2), or check it is fresh.

    .venv/bin/python scripts/gen_protos.py           # rewrite protos/radixmesh/v*/*_pb2*.py[i]
    .venv/bin/python scripts/gen_protos.py --check   # exit 1 naming stale files, write nothing

Layout choice: protoc runs with `-I protos`, so every .proto is known by its
package path (`radixmesh/v1/common.proto`): that is the name other .proto files
import, the file name reflection serves, and what a non-Python client would
use. protoc then writes Python imports rooted at `radixmesh.v1`, which only
resolve if `protos/` is on sys.path. Rather than putting it there (a second
import root that every entry point must remember), the generated files are
post-processed so they live in the ordinary package tree: `from radixmesh.v1
import x_pb2` becomes `from protos.radixmesh.v1 import x_pb2`, and the module
name given to the protobuf builder (it becomes the messages' `__module__`,
used by pickle) becomes `protos.radixmesh.v1.x_pb2`. The rewrite is a fixed
set of line-anchored regexes, so generation stays deterministic for a given
grpcio-tools version (the generated headers name that version: a different
grpcio-tools makes `--check` report the files as stale, on purpose).
"""
from __future__ import annotations

import argparse
import importlib.resources
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "protos"  # the -I root: .proto names are relative to it
PACKAGE_ROOT = PROTO_ROOT / "radixmesh"  # one folder per contract version: v1, v2, ...
PY_PREFIX = "protos."  # what the generated modules' import path gains
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")

# (pattern, replacement) applied line by line, anchored so that only import
# statements and the builder's module-name argument are touched, never the
# serialized descriptor or the RPC paths ("/radixmesh.v1.Worker/Step").
_REWRITES = [
    (re.compile(r"^from radixmesh\.(v\d+) import ", re.M), rf"from {PY_PREFIX}radixmesh.\1 import "),
    (re.compile(r"^import radixmesh\.(v\d+)\.", re.M), rf"import {PY_PREFIX}radixmesh.\1."),
    (re.compile(r"^(_builder\.BuildTopDescriptorsAndMessages\(DESCRIPTOR, ')radixmesh\.(v\d+)\.", re.M),
     rf"\1{PY_PREFIX}radixmesh.\2."),
]


def version_dirs() -> list[Path]:
    return sorted(p for p in PACKAGE_ROOT.iterdir() if p.is_dir() and re.fullmatch(r"v\d+", p.name))


def _is_generated(path: Path) -> bool:
    return path.name.endswith(GENERATED_SUFFIXES)


def generate(out_root: Path) -> dict[str, bytes]:
    """Run protoc over protos/radixmesh/v*/*.proto into out_root.

    Returns {path relative to protos/radixmesh (v1/x_pb2.py): post-processed content} for every
    generated file.
    Raises RuntimeError with protoc's exit status when compilation fails
    (protoc has already printed the reason to stderr).
    """
    from grpc_tools import protoc  # imported here so --help works without grpcio-tools

    protos = sorted(p for d in version_dirs() for p in d.glob("*.proto"))
    if not protos:
        raise RuntimeError(f"no .proto files under {PACKAGE_ROOT}")
    well_known = importlib.resources.files("grpc_tools") / "_proto"  # google/protobuf/*.proto
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(str(p.relative_to(PROTO_ROOT)) for p in protos),
    ]
    # protoc resolves the relative .proto names against the -I roots, not the cwd.
    status = protoc.main(args)
    if status != 0:
        raise RuntimeError(f"protoc failed with exit status {status}")
    files: dict[str, bytes] = {}
    for version in version_dirs():
        for path in sorted((out_root / "radixmesh" / version.name).iterdir()):
            if not _is_generated(path):
                continue
            text = path.read_text(encoding="utf-8")
            for pattern, repl in _REWRITES:
                text = pattern.sub(repl, text)
            files[f"{version.name}/{path.name}"] = text.encode("utf-8")
    return files


def _committed() -> list[Path]:
    return sorted(p for d in version_dirs() for p in d.iterdir() if _is_generated(p))


def stale_files(fresh: dict[str, bytes]) -> list[str]:
    """Names (relative to the repo) of committed files that differ from `fresh`,
    are missing, or are generated leftovers of a deleted .proto."""
    stale = []
    for name, content in fresh.items():
        target = PACKAGE_ROOT / name
        if not target.exists() or target.read_bytes() != content:
            stale.append(str(target.relative_to(REPO)))
    for path in _committed():
        if str(path.relative_to(PACKAGE_ROOT)) not in fresh:
            stale.append(str(path.relative_to(REPO)))
    return sorted(stale)


def write(fresh: dict[str, bytes]) -> list[str]:
    """Make the version folders hold exactly `fresh`; returns the names it changed."""
    changed = stale_files(fresh)
    for path in _committed():
        if str(path.relative_to(PACKAGE_ROOT)) not in fresh:
            path.unlink()
    for name, content in fresh.items():
        target = PACKAGE_ROOT / name
        if not target.exists() or target.read_bytes() != content:
            target.write_bytes(content)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 and name the stale files if the "
                             "committed generated code differs from a fresh generation")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="radixmesh-protos-") as tmp:
        try:
            fresh = generate(Path(tmp))
        except RuntimeError as e:
            print(f"gen_protos: {e}", file=sys.stderr)
            return 2
    if args.check:
        stale = stale_files(fresh)
        if stale:
            print("gen_protos: generated code is stale; run `python scripts/gen_protos.py`:",
                  file=sys.stderr)
            for name in stale:
                print(f"  {name}", file=sys.stderr)
            return 1
        print(f"gen_protos: {len(fresh)} generated files are up to date")
        return 0
    changed = write(fresh)
    print(f"gen_protos: wrote {len(fresh)} files ({len(changed)} changed) into "
          f"{PACKAGE_ROOT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
