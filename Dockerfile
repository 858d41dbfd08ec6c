# The operator image: kopf + the Kubernetes client + the API models. No JAX, no torch: the
# operator imports only lora_trainer.config / storage from the trainer package.
#   docker build -t ghcr.io/lora-operator/lora-operator:0.1.0 .
FROM python:3.11-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY operator/ operator/
COPY trainer_image/lora_trainer/ trainer_image/lora_trainer/
# Only the `operator` extra, every version pinned by constraints.txt.
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install -c constraints.txt ".[operator]"

FROM python:3.11-slim-bookworm
# A fixed non-root UID/GID (the Helm chart's runAsUser/runAsGroup default to it).
RUN groupadd --gid 10001 operator \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin operator
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp
USER 10001:10001
# kopf's liveness endpoint (the chart probes /healthz here).
EXPOSE 8080
ENTRYPOINT ["lora-operator", "run"]
