# syntax=docker/dockerfile:1.7
# Gateway (OpenAI API over HTTP, gRPC to the backends); CPU only. Build from the repository root:
#   docker build -f deploy/docker/gateway.Dockerfile -t vlm-encode-once/gateway:0.1.0 .
# The gateway checks inline blobs with numpy (shared/blob.py holds no torch): no torch, no
# transformers in this image.

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
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --gid 10001 app \
    && useradd --uid 10001 --gid 10001 --home-dir /home/app --create-home --shell /usr/sbin/nologin app
# The gateway's dependencies from their lock (requirements/gateway.txt), each file checked against
# its hash; then the project's wheel with its own extra and no index: everything the extra names
# must already be there, so a lock that misses something fails the build here.
RUN --mount=type=bind,source=requirements/gateway.txt,target=/tmp/lock.txt \
    pip install --require-hashes -r /tmp/lock.txt
COPY --from=wheel /wheels /wheels
RUN pip install "$(ls /wheels/*.whl)[gateway]" --no-index && rm -rf /wheels

USER 10001:10001
WORKDIR /home/app
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(f\"http://127.0.0.1:{os.environ.get('GATEWAY_PORT', '8000')}/livez\", timeout=2)"]
CMD ["python", "-m", "gateway"]
