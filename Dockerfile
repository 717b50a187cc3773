# One image for every radixmesh service (compose.yaml picks the service with its command),
# built with no registry or index reachable but Debian's mirror:
#   scripts/make_base_image.sh     # debian:bookworm-slim from debootstrap, where it cannot be pulled
#   scripts/make_wheels.sh         # build/wheels: torch's CPU wheel and every other dependency
#   docker build -t radixmesh .    # or: docker compose build / docker-compose build
#   docker run --rm radixmesh serve worker --listen 0.0.0.0:50053
# Plain Dockerfile syntax (no RUN --mount): docker-compose 1.29's classic builder builds it too.
ARG BASE_IMAGE=debian:bookworm-slim

# Python 3.11 (bookworm's, matching build/wheels) and what the CPU kernels (kernels/cpu) compile
# with where they run: g++ (OpenMP included) and Python's headers; torch brings its own headers
# and the venv ninja. Without them the worker falls back to plain torch, about twice as slow.
# libibverbs1: Mooncake's transfer engine loads it (--disaggregation-transfer-backend mooncake).
FROM ${BASE_IMAGE} AS system
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-dev g++ libibverbs1 \
 && rm -rf /var/lib/apt/lists/* /usr/lib/python3.11/config-3.11-*/libpython3.11*.a

# The virtual environment: exactly the wheels in build/wheels, offline and without resolving
# (scripts/make_wheels.sh resolved them; it leaves out xgrammar's CUDA-only triton).
FROM system AS venv
RUN apt-get update && apt-get install -y --no-install-recommends python3-venv && rm -rf /var/lib/apt/lists/*
# (The pattern lets a missing build/wheels reach the explanation below instead of COPY's error.)
COPY pyproject.toml build/wheel[s] /tmp/wheels/
RUN ls /tmp/wheels/*.whl >/dev/null 2>&1 \
 || { echo "build/wheels is empty: run scripts/make_wheels.sh first (the image installs from it, offline)" >&2; exit 1; }
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install -q --no-cache-dir --disable-pip-version-check --no-index --no-deps \
      $(ls /tmp/wheels/*.whl | grep -v /radixmesh-)
# The project from this checkout (not build/wheels' copy), so a source change rebuilds from here.
COPY pyproject.toml README.md /src/
COPY protos /src/protos
COPY services /src/services
COPY kernels /src/kernels
RUN /opt/venv/bin/pip wheel -q --no-cache-dir --disable-pip-version-check --no-index --no-deps \
      --no-build-isolation --wheel-dir /dist /src

FROM system AS runtime
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    RADIXMESH_KERNEL_BUILD_DIR=/var/cache/radixmesh/kernels HOME=/home/radixmesh
# The kernels' build cache and the kvstore's disk tier (a named volume in compose.fleet.yaml
# starts as a copy of this folder, owner included), both the service user's.
RUN useradd --create-home --uid 10001 radixmesh \
 && install -d -o radixmesh -g radixmesh /var/cache/radixmesh/kernels /var/lib/radixmesh/kvstore
COPY --from=venv /opt/venv /opt/venv
COPY --from=venv /dist /tmp/dist
RUN pip install -q --no-cache-dir --disable-pip-version-check --no-index --no-deps /tmp/dist/*.whl \
 && rm -rf /tmp/dist
USER radixmesh
WORKDIR /home/radixmesh
# Compile the kernels now, for this machine's CPU (-march=native), so no container pays it on
# its first start; on another CPU they are rebuilt on first use into the same folder.
ARG PREBUILD_KERNELS=1
RUN if [ "$PREBUILD_KERNELS" = 1 ]; then python -m kernels.build_all; fi
# The compose stack's trace collector (deploy/collector), run from this image.
COPY deploy/collector/otlp_collector.py /opt/radixmesh/otlp_collector.py

# gRPC ports of the services (compose.yaml's choice) and the gateway's HTTP port.
EXPOSE 50050 50051 50052 50053 50054 50055 50056 8000
ENTRYPOINT ["radixmesh"]
CMD ["--help"]
