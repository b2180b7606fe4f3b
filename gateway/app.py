"""The gateway's FastAPI app: OpenAI chat completions, model listing, image encoding, health."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from gateway.backends import Backends
from gateway.chat import generate, prepare
from gateway.errors import error_response, install_error_handlers
from gateway.openai_format import completion, event_stream
from gateway.schemas import ChatCompletionRequest, EncodeImageRequest, EncodeImageResponse
from gateway.settings import GatewaySettings
from shared.errors import TooLarge
from shared.sdk import GenerationChunk


async def _primed(chunks: AsyncIterator[GenerationChunk]) -> AsyncIterator[GenerationChunk]:
    """Pulls the first chunk now, so errors before any output become HTTP errors, not stream events."""
    first = await anext(chunks)

    async def replay() -> AsyncIterator[GenerationChunk]:
        yield first
        async for chunk in chunks:
            yield chunk

    return replay()


def create_app(settings: GatewaySettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.backends = Backends(settings)
        yield
        await app.state.backends.close()

    app = FastAPI(title="VLM encode-once gateway", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)

    @app.middleware("http")
    async def limits_and_request_id(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        request.state.request_id = request_id
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > settings.max_body_bytes:
            response: Response = error_response(TooLarge(f"request body exceeds {settings.max_body_bytes} bytes"))
        else:
            response = await call_next(request)
        response.headers["x-request-id"] = request_id
        return response

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> dict[str, Any] | StreamingResponse:
        backends: Backends = request.app.state.backends
        backends.llm_for(body.model)  # unknown model: 404 before any image is encoded
        chat = await prepare(body, backends, settings.max_images_per_request)
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        chunks = generate(body, chat, backends, request.state.request_id)
        if not body.stream:
            return await completion(completion_id, body.model, chunks)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = event_stream(completion_id, body.model, await _primed(chunks), include_usage)
        return StreamingResponse(events, media_type="text/event-stream")

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        names = request.app.state.backends.model_names
        return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "vlm-encode-once"} for n in names]}

    @app.post("/v1/images/encode")
    async def encode_image(body: EncodeImageRequest, request: Request) -> EncodeImageResponse:
        """Encodes an image once (or finds it stored) and returns the key to reference it by."""
        result = await request.app.state.backends.encoder.encode(
            image_url=body.image_url, min_pixels=body.min_pixels, max_pixels=body.max_pixels
        )
        return EncodeImageResponse(
            key=result.key, grid_thw=result.grid_thw, num_tokens=result.num_tokens,
            encoder_id=result.encoder_id, cache_hit=result.cache_hit,
        )

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        """200 when every backend reports SERVING, else 503 with each backend's state."""
        backends = await request.app.state.backends.health()
        ok = all(backends.values())
        return JSONResponse({"status": "ok" if ok else "degraded", "backends": backends}, status_code=200 if ok else 503)

    return app
