# syntax=docker/dockerfile:1.7
# Encoder service (vision tower on a GPU). Build from the repository root:
#   docker build -f deploy/docker/encoder.Dockerfile -t vlm-encode-once/encoder:0.1.0 .
# PyPI's torch wheel for Linux x86_64 is a CUDA build (the driver comes from the host through
# the NVIDIA container toolkit): the default installs requirements/encoder-cuda.txt, torch and
# its CUDA libraries included, every file checked against its hash. CPU image for the dev overlay
# (torch's CPU build from that index, then requirements/encoder.txt, which leaves torch out):
#   docker build -f deploy/docker/encoder.Dockerfile -t vlm-encode-once/encoder:dev-cpu \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .

# The project as a wheel, so the final image holds no source tree or build leftovers.
FROM python:3.11-slim-bookworm AS wheel
WORKDIR /src
COPY pyproject.toml ./
COPY shared ./shared
COPY encoder_service ./encoder_service
COPY llm_service ./llm_service
COPY gateway ./gateway
COPY model_builders ./model_builders
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim-bookworm
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://pypi.org/simple
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    HF_HUB_OFFLINE=1
RUN groupadd --gid 10001 app \
    && useradd --uid 10001 --gid 10001 --home-dir /home/app --create-home --shell /usr/sbin/nologin app
# The locked dependencies (requirements/compile.sh). Another index: torch alone from it first
# (--no-deps: its dependencies are in the lock; 2.13.0+cpu meets the project's torch==2.13.0).
RUN --mount=type=bind,source=requirements,target=/tmp/requirements \
    if [ "${TORCH_INDEX_URL}" = https://pypi.org/simple ]; then \
        pip install --require-hashes -r /tmp/requirements/encoder-cuda.txt; \
    else \
        pip install --no-deps --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
        && pip install --require-hashes -r /tmp/requirements/encoder.txt; \
    fi
COPY --from=wheel /wheels /wheels
# The project's wheel with its own extra and no index: a lock that misses something fails here.
RUN pip install "$(ls /wheels/*.whl)[encoder]" --no-index && rm -rf /wheels

USER 10001:10001
WORKDIR /home/app
# gRPC (ENCODER_PORT) and /metrics (ENCODER_METRICS_PORT).
EXPOSE 50051 9090
# Kubernetes probes the gRPC health service natively; no HEALTHCHECK here.
CMD ["python", "-m", "encoder_service"]
