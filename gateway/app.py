"""The gateway's FastAPI app: OpenAI chat completions, model listing, image and video encoding, health."""

from __future__ import annotations

import base64
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway import metrics, summary
from gateway.access import Admission, ApiKeys
from gateway.backends import Backends
from gateway.chat import generate, prepare
from gateway.errors import ENCODING, failing_as, install_error_handlers
from gateway.event_response import EventStreamResponse
from gateway.exchange import ExchangeMiddleware, on_exchange_end
from gateway.openai_format import IndexedChunks, completion, event_stream
from gateway.schemas import ChatCompletionRequest, EncodeImageRequest, EncodeMediaResponse, EncodeVideoRequest
from gateway.settings import GatewaySettings
from gateway.unsupported import refuse_unsupported
from shared.sdk import AsyncEncoderClient, EncodedMedia

logger = logging.getLogger(__name__)
OPEN_PATHS = ("/health", "/livez", "/readyz", "/metrics", "/docs", "/openapi.json")


async def _primed(chunks: IndexedChunks) -> IndexedChunks:
    """Pulls the first chunk now, so errors before any output become HTTP errors, not stream events."""
    first = await anext(chunks)

    async def replay() -> IndexedChunks:
        yield first
        async for chunk in chunks:
            yield chunk

    return replay()


async def _encode_response(
    encoder: AsyncEncoderClient, result: EncodedMedia, return_embeddings: bool
) -> EncodeMediaResponse:
    summary.current().note_keys([result.key])
    blob = await encoder.get_embedding(result.key) if return_embeddings else None
    return EncodeMediaResponse(
        key=result.key, grid_thw=result.grid_thw, num_tokens=result.num_tokens, encoder_id=result.encoder_id,
        cache_hit=result.cache_hit, embeddings=base64.b64encode(blob).decode() if blob is not None else None,
    )  # fmt: skip


def model_object(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "vlm-encode-once"}


def create_app(settings: GatewaySettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.backends = Backends(settings)
        yield
        await app.state.backends.close()

    # redirect_slashes off: Starlette would answer "/v1/chat/completions/" with a 307 to a URL it
    # builds from the client's Host header (and always http). A wrong path is a 404 like any other.
    app = FastAPI(title="VLM encode-once gateway", version="0.1.0", lifespan=lifespan, redirect_slashes=False)
    app.state.settings = settings  # the server around the app is configured from them too (gateway.http_protocol)
    install_error_handlers(app)
    # Added last, so it wraps every other middleware (see gateway.exchange).
    app.add_middleware(
        ExchangeMiddleware,
        api_keys=ApiKeys(settings.api_keys),
        max_body_bytes=settings.max_body_bytes,
        open_paths=OPEN_PATHS,
        routes=app.router.routes,
    )
    admission = app.state.admission = Admission(settings.max_concurrent_requests)
    # A model's "created": when this gateway began serving it (a Unix time, as OpenAI's; it was 0, 1970).
    models_created = int(time.time())

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> JSONResponse | EventStreamResponse:
        """OpenAI chat completions; image parts are encoded once and shared by every model."""
        summary.current().model = body.model
        if body.model_extra:
            refuse_unsupported(body.model_extra)
            logger.info("ignoring unknown fields %s", sorted(body.model_extra))  # the line names the request
        backends: Backends = request.app.state.backends
        backends.check_model(body.model)  # unknown model: 404 before any image is encoded
        # The slot is held exactly as long as the HTTP exchange, however it ends: a streaming
        # client may leave before the response head, and then no body iterator ever runs.
        on_exchange_end(request, admission.enter())
        with metrics.STAGE_SECONDS.labels("prepare").time():
            chat = await prepare(body, backends, settings, request.state.request_id)
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        chunks = generate(body, chat, backends, request.state.request_id)
        on_exchange_end(request, chunks.aclose)  # a stream nobody reads stops generating
        if not body.stream:
            # A response, not a dict: FastAPI would walk a dict with jsonable_encoder first, ~7x the
            # cost of json.dumps, all of it on the event loop (a third of a second, every stream on
            # the gateway stalled, for 1,000 tokens with top_logprobs 20).
            return JSONResponse(await completion(completion_id, body.model, body.n, chunks))
        options = body.stream_options
        include_usage, continuous_usage = (
            (options.include_usage, options.continuous_usage) if options else (False, False)
        )
        events = event_stream(completion_id, body.model, body.n, await _primed(chunks), include_usage, continuous_usage)
        return EventStreamResponse(events)

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        names = request.app.state.backends.model_names
        return {"object": "list", "data": [model_object(name, models_created) for name in names]}

    @app.get("/v1/models/{model:path}")  # path: a fine-tune's name may hold "/" ("org/name")
    async def retrieve_model(model: str, request: Request) -> dict[str, Any]:
        """One model, as the OpenAI clients' models.retrieve reads it; 404 model_not_found else."""
        request.app.state.backends.check_model(model)
        return model_object(model, models_created)

    @app.post("/v1/images/encode")
    async def encode_image(body: EncodeImageRequest, request: Request) -> EncodeMediaResponse:
        """Encodes an image once (or finds it stored) and returns the key to reference it by."""
        on_exchange_end(request, admission.enter())  # a tower forward pass: the costliest work we do
        encoder = request.app.state.backends.encoder
        with failing_as(ENCODING):
            result = await encoder.encode(
                image_url=body.image_url,
                min_pixels=body.min_pixels,
                max_pixels=body.max_pixels,
                request_id=request.state.request_id,
            )
            return await _encode_response(encoder, result, body.return_embeddings)

    @app.post("/v1/videos/encode")
    async def encode_video(body: EncodeVideoRequest, request: Request) -> EncodeMediaResponse:
        """Encodes a video (its frames, in order) once and returns the key for a video_embeds part."""
        on_exchange_end(request, admission.enter())
        encoder = request.app.state.backends.encoder
        with failing_as(ENCODING):
            result = await encoder.encode_video(
                body.frames, min_pixels=body.min_pixels, max_pixels=body.max_pixels, request_id=request.state.request_id
            )
            return await _encode_response(encoder, result, body.return_embeddings)

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/livez")
    async def livez() -> dict[str, str]:
        """Liveness: the process answers (no backend is asked)."""
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(request: Request) -> JSONResponse:
        """Readiness: 503 while the encoder is not SERVING. Every model's LLM services are asked
        too, and a model none of whose services is SERVING is named (status `degraded`), but it
        keeps the gateway ready: it answers 503 by itself, and must not take the gateway, and
        every other model, out of the Service."""
        backends: Backends = request.app.state.backends
        serving = await backends.health()
        encoder_ready = serving[backends.encoder.target]
        models_not_ready = [
            name
            for name in backends.model_names
            if not any(serving[client.target] for client in backends.check_model(name).clients)
        ]
        status = "not ready" if not encoder_ready else "degraded" if models_not_ready else "ok"
        return JSONResponse(
            {"status": status, "encoder_ready": encoder_ready, "models_not_ready": models_not_ready},
            status_code=200 if encoder_ready else 503,
        )

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        """200 when every backend reports SERVING, else 503 with each backend's state, by name."""
        backends = await request.app.state.backends.health_by_name()
        ok = all(backends.values())
        return JSONResponse(
            {"status": "ok" if ok else "degraded", "backends": backends}, status_code=200 if ok else 503
        )

    return app
