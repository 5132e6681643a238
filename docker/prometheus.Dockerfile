# Prometheus for docker-compose.yml's monitoring, from Debian's package on the same base image as
# pdserve (builds with no registry access). Its configuration and rules are mounted from
# monitoring/prometheus/ by the compose file.
ARG BASE=python:3.11-slim
FROM ${BASE}
RUN set -eux; \
    apt-get update; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus; \
    rm -rf /var/lib/apt/lists/*
USER prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/var/lib/prometheus/metrics2", \
     "--web.enable-lifecycle"]
