# syntax=docker/dockerfile:1.7
# LLM service, one image for every fine-tune (the checkpoint is mounted, never baked in).
# Build from the repository root:
#   GPU, vLLM engine (default target):
#     docker build -f deploy/docker/llm.Dockerfile -t vlm-encode-once/llm:0.1.0 .
#   CPU, transformers engine, for the dev overlay:
#     docker build -f deploy/docker/llm.Dockerfile --target cpu -t vlm-encode-once/llm:dev-cpu .
# vLLM 0.32.0 pins torch==2.13.0 and transformers<5.20, the versions the project pins too
# (pyproject.toml). The GPU target installs into vLLM's image under a constraints file made from
# that image's own versions, so pip cannot move vLLM's dependencies; the build fails instead.

FROM python:3.11-slim-bookworm AS wheel
WORKDIR /src
COPY pyproject.toml ./
COPY shared ./shared
COPY encoder_service ./encoder_service
COPY llm_service ./llm_service
COPY gateway ./gateway
COPY model_builders ./model_builders
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# --- CPU: the transformers engine, for clusters without GPUs --------------------------------
FROM python:3.11-slim-bookworm AS cpu
ARG TORCH_VERSION=2.13.0
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1
RUN groupadd --gid 10001 app \
    && useradd --uid 10001 --gid 10001 --home-dir /home/app --create-home --shell /usr/sbin/nologin app
# torch's CPU build alone (its dependencies are in the lock), then the lock, every file checked
# against its hash; then the project's wheel with no index: a lock that misses something fails here.
RUN pip install --no-deps --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"
RUN --mount=type=bind,source=requirements/llm.txt,target=/tmp/lock.txt \
    pip install --require-hashes -r /tmp/lock.txt
COPY --from=wheel /wheels /wheels
RUN pip install "$(ls /wheels/*.whl)[llm]" --no-index && rm -rf /wheels
USER 10001:10001
WORKDIR /home/app
EXPOSE 50061 9090
CMD ["python", "-m", "llm_service"]

# --- GPU: vLLM's CUDA image (default target) ------------------------------------------------
FROM vllm/vllm-openai:v0.32.0 AS gpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1 \
    HOME=/home/app
RUN groupadd --gid 10001 app \
    && useradd --uid 10001 --gid 10001 --home-dir /home/app --create-home --shell /usr/sbin/nologin app
COPY --from=wheel /wheels /wheels
# Into the image's own Python, beside vLLM (PIP_BREAK_SYSTEM_PACKAGES: that Python may be marked
# as system-managed; this image is the only user of it). image-pins.txt is the image's own
# versions, a constraints file: what vLLM's image has stays as it is. What it lacks comes from our
# lock, hashes checked (lock_beyond_image.py); then the project's wheel with no index, under the
# same constraints, so a pin of ours the image does not meet fails the build instead of moving vLLM.
ENV PIP_BREAK_SYSTEM_PACKAGES=1
RUN --mount=type=bind,source=requirements/llm.txt,target=/tmp/lock.txt \
    --mount=type=bind,source=deploy/docker/lock_beyond_image.py,target=/tmp/lock_beyond_image.py \
    python3 -m pip list --format=freeze --exclude-editable > /tmp/image-pins.txt \
    && python3 /tmp/lock_beyond_image.py /tmp/lock.txt /tmp/image-pins.txt > /tmp/missing.txt \
    && python3 -m pip install --require-hashes -r /tmp/missing.txt \
    && python3 -m pip install "$(ls /wheels/*.whl)[llm]" --no-index -c /tmp/image-pins.txt \
    && rm -rf /wheels /tmp/image-pins.txt /tmp/missing.txt \
    && python3 -c "import llm_service.server, shared.grpc_server"
USER 10001:10001
WORKDIR /home/app
EXPOSE 50061 9090
# The base image's entrypoint is vLLM's own HTTP server; this image serves llm_service's gRPC.
ENTRYPOINT []
CMD ["python3", "-m", "llm_service"]
