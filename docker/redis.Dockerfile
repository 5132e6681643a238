# Redis for docker-compose.yml, from Debian's package on the same base image as pdserve, so that
# a host that can build pdserve (its own base image, no registry) can build this too.
ARG BASE=python:3.11-slim
FROM ${BASE}
RUN set -eux; \
    apt-get update; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server; \
    rm -rf /var/lib/apt/lists/*
USER redis
EXPOSE 6379
CMD ["redis-server", "--save", "", "--appendonly", "no"]
