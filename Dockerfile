# syntax=docker/dockerfile:1
# One image for every rollgate service; the command picks which one runs:
#   docker run rollgate services.router --host 0.0.0.0 --port 50051
#   docker run rollgate services.gateway --host 0.0.0.0 --port 8080
# The runtime stage needs no writes outside /tmp, so it runs with a read-only root filesystem.

ARG PYTHON_IMAGE=python:3.11-slim

# ---- builder: wheels for rollgate and every pinned dependency --------------------------------
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# Metadata first so the dependency layer is cached across source edits.
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY schema ./schema
COPY stackconfig ./stackconfig
COPY chatml ./chatml
COPY grpcpoller ./grpcpoller
COPY services ./services
COPY rollgate ./rollgate
RUN pip wheel --wheel-dir /wheels .

# ---- runtime ----------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp \
    TMPDIR=/tmp \
    ROLLGATE_LOG_JSON=1
RUN groupadd --system --gid 10001 rollgate \
 && useradd --system --uid 10001 --gid 10001 --home-dir /nonexistent --no-create-home \
        --shell /usr/sbin/nologin rollgate
# --compile writes the .pyc files now, while the filesystem is still writable.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels --compile rollgate
# Health probe for docker-compose (Kubernetes uses its native gRPC and HTTP probes).
COPY --chmod=0555 deploy/docker/healthcheck.py /opt/rollgate/healthcheck.py
WORKDIR /tmp
USER 10001:10001
# Service ports, then their metrics ports (GET /metrics; docs/metrics.md).
EXPOSE 8080 50051 50052 50061 8000 9080 9051 9052 9061
ENTRYPOINT ["python", "-m"]
CMD ["services.gateway", "--host", "0.0.0.0", "--port", "8080"]
