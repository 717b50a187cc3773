#!/usr/bin/env bash
# The wheels --attention-backend flashinfer needs on the GPU machine, which reaches no package
# registry (it has CUDA torch, triton, nvcc, ninja, einops, nvidia-ml-py, tabulate, numpy).
#     bash bench/gpu_wheels.sh [DIR]        (default wheels/, git-ignored; needs PyPI, ~105 MB)
# Downloads, without dependencies:
#   flashinfer-python  pure Python plus CUDA sources: its kernels are JIT-compiled with nvcc on
#                      first use (minutes per variant, cached in ~/.cache/flashinfer);
#   apache-tvm-ffi     its one compiled import-time dependency, for CPython 3.12 on x86-64.
# Its other requirements (cuda-python, cudnn-frontend, cutlass-dsl, nccl4py, cuda-tile, ...) are
# imported only by kernels this backend does not call, so they are left out.
#
# The device tool carries at most 64 MiB a call and the flashinfer wheel is ~97 MiB, so it is
# split into parts under 60 MiB: carry them in separate calls (ignored paths stay on a warm
# machine between calls), then on the GPU machine, from the repository root:
#     W=flashinfer_python-0.7.4-py3-none-any.whl; cat wheels/$W.part-* > /tmp/$W
#     python3 -m pip install -q --no-index --no-deps --target /tmp/site wheels/*.whl /tmp/$W
#     export PYTHONPATH=/tmp/site:$PYTHONPATH
set -euo pipefail
FLASHINFER=0.7.4        # the version services/worker/attention/flashinfer_backend.py targets
TVM_FFI=0.1.15.post2    # flashinfer-python 0.7.4 asks for apache-tvm-ffi >=0.1.11,<0.2
REPO=$(cd "$(dirname "$0")/.." && pwd)
DIR=${1:-$REPO/wheels}
PY=${PYTHON:-$REPO/.venv/bin/python}
[ -x "$PY" ] || PY=python3
mkdir -p "$DIR"
rm -f "$DIR"/flashinfer_python-*.whl*
"$PY" -m pip download -q --no-deps -d "$DIR" "flashinfer-python==$FLASHINFER"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$DIR" "apache-tvm-ffi==$TVM_FFI"
WHEEL=$(ls "$DIR"/flashinfer_python-"$FLASHINFER"-*.whl)
split -b 60m -d "$WHEEL" "$WHEEL.part-"
rm "$WHEEL"
ls -l "$DIR"
