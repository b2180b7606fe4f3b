"""One Generate call: resolve images and videos (fetch + validate), render the prompt, stream from
the engine.

Every blob is validated before the engine sees it: engines crash or silently misbehave on a bad
shape (DESIGN.md, Engines). Each item reaches the engine once, as a MediaItem in prompt order.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from llm_service import metrics
from llm_service.blob_cache import BlobCache
from llm_service.blob_fetch import decode_items_async, fetch_items
from llm_service.blob_tensors import embeds_tensor, grid_tensor
from llm_service.chat_request import ChatRequest, MediaInput, PromptMessage
from llm_service.context import fit_to_context, refuse_text_over_context
from llm_service.engines.base import Engine, EngineRequest, GenerationDelta, MediaItem
from llm_service.prompt import PromptBuilder
from shared import tracing
from shared.blob import BlobRules, EmbeddingBlob
from shared.errors import IncompatibleEncoder, InvalidEmbedding, InvalidInput, ModelNotFound, clip
from shared.keys import encoder_id_of_key
from shared.progress_watch import ProgressWatch
from shared.store import EmbeddingStore

# Texts this long (~30 ms of tokenizing) go to a worker thread. Most prompts are far shorter, and
# for them the hand-off (~0.1 ms) would cost more than the loop time it frees.
THREAD_TOKENIZE_CHARS = 64 * 1024


@dataclass
class LLMCore:
    model_name: str
    engine: Engine
    prompt_builder: PromptBuilder
    store: EmbeddingStore
    rules: BlobRules
    max_media: int  # images and videos together, per request
    cache: BlobCache
    progress: ProgressWatch  # tokens out of the engine, while requests are in it
    # Blob fetches under way, by key; None when one failed (its waiters then fetch on their own).
    _fetching: dict[str, asyncio.Future[EmbeddingBlob | None]] = field(default_factory=dict, init=False)

    async def generate(self, request: ChatRequest) -> AsyncIterator[GenerationDelta]:
        """Streams the engine's deltas for a validated request."""
        if request.model != self.model_name:
            raise ModelNotFound(
                f"model {clip(request.model)!r} is not served here (this service serves {self.model_name!r})",
                param="model",
            )
        media = request.media
        keys = [item.key for item in media if item.key is not None]
        tracing.annotate({tracing.MODEL: request.model, tracing.MEDIA_KEYS: keys})
        with metrics.REQUEST_STAGE_SECONDS.labels("media").time():
            blobs = await self._resolve_media(media)
        with metrics.REQUEST_STAGE_SECONDS.labels("prompt").time():
            prompt_ids = await self._prompt_ids(request.messages)
            items = [
                MediaItem(part.modality, embeds_tensor(blob), grid_tensor(blob), _media_uuid(part))
                for part, blob in zip(media, blobs, strict=True)
            ]
        engine_request = EngineRequest(request.request_id, prompt_ids, items)
        engine_request.sampling = fit_to_context(
            engine_request.prompt_tokens, request.sampling, self.engine.max_model_len
        )
        submitted: float | None = time.perf_counter()
        engine_attributes = {tracing.MODEL: self.model_name, "vlm.prompt_tokens": engine_request.prompt_tokens}
        metrics.REQUESTS_WAITING.inc()
        try:
            with (
                tracing.step_span("engine generate", engine_attributes) as span,
                metrics.REQUESTS_IN_ENGINE.track_inprogress(),
            ):
                stream = self.engine.generate(engine_request)
                while (delta := await self._next_delta(stream)) is not None:
                    if submitted is not None:
                        metrics.REQUEST_STAGE_SECONDS.labels("first_token").observe(time.perf_counter() - submitted)
                        metrics.REQUESTS_WAITING.dec()
                        submitted = None
                    if delta.finish_reason is not None:
                        span.set_attribute("vlm.completion_tokens", delta.completion_tokens)
                    yield delta
        finally:  # however it ended: failed, cancelled, or the client went away before a token
            if submitted is not None:
                metrics.REQUESTS_WAITING.dec()

    async def _prompt_ids(self, messages: list[PromptMessage]) -> list[int]:
        """The prompt's token ids. A text surely too long for the context is refused before it is
        tokenized, and a long one is tokenized on a worker thread: tokenizing takes ~0.5 s per
        million characters, during which this loop would serve no other request (a 40 MB prompt
        held every request of the service for 30-45 s, and its health checks failed)."""
        builder = self.prompt_builder
        try:
            text = builder.render(messages)
            refuse_text_over_context(len(text), builder.min_tokens(text), self.engine.max_model_len)
            if len(text) < THREAD_TOKENIZE_CHARS:
                return builder.tokenize(text, messages)
            return await asyncio.to_thread(builder.tokenize, text, messages)
        except ValueError as error:
            raise InvalidInput(str(error), param="messages") from None

    async def _next_delta(self, stream: AsyncIterator[GenerationDelta]) -> GenerationDelta | None:
        """The engine's next delta, or None at its end. Only this wait is the engine's work for
        the hung-engine watch (shared/progress_watch.py): while the request is held at `yield` by
        a consumer slow to read, the engine owes it nothing."""
        with self.progress.working():
            try:
                delta = await anext(stream)
            except StopAsyncIteration:
                return None
        self.progress.progressed()
        return delta

    async def _resolve_media(self, media: list[MediaInput]) -> list[EmbeddingBlob]:
        """Each item's validated blob, in order: cached, fetched in one round trip, or inline."""
        if len(media) > self.max_media:
            raise InvalidInput(
                f"{len(media)} images and videos in one request; the limit is {self.max_media}", param="messages"
            )
        holders = _stored_once(media)
        for holder in holders:
            self._check_encoder(holder)
        by_key = {item.key: blob for item in holders if item.key and (blob := self.cache.get(item.key)) is not None}
        await self._fetch_into(by_key, [item for item in holders if item.key not in by_key])
        inline = [item for item in media if item.key is None]
        decoded_inline = iter(
            await decode_items_async([item.blob for item in inline], self.rules, "inline embedding", inline)
        )
        blobs = [by_key[item.key] if item.key is not None else next(decoded_inline) for item in media]
        for index, (item, blob) in enumerate(zip(media, blobs, strict=True)):
            _check_modality(item, blob, index)
        return blobs

    def _check_encoder(self, item: MediaInput) -> None:
        key = item.key or ""
        encoder_id = encoder_id_of_key(key, param=item.param or "key")
        if encoder_id not in self.rules.accepted_encoder_ids:
            raise IncompatibleEncoder(
                f"key {clip(key)!r} was made by encoder {encoder_id!r}, which model {self.model_name!r} does not accept",
                param=item.param,
            )

    async def _fetch_into(self, by_key: dict[str, EmbeddingBlob], items: list[MediaInput]) -> None:
        """Fetches the items' keys in one round trip, validates and caches them. A key that another
        request is fetching already is awaited, not fetched again: a burst of questions on a new
        image costs one GET per pod, not one per question."""
        joined = {item.key: (item, self._fetching[item.key]) for item in items if item.key in self._fetching}
        if own := [item for item in items if item.key not in joined]:
            await self._fetch_own(by_key, own)
        for key, (item, pending) in joined.items():
            # Shielded: this request going away must not cancel the fetch others wait on.
            blob = await asyncio.shield(pending)
            if blob is None:  # that fetch failed or was cancelled: fetch (and report errors) anew
                await self._fetch_own(by_key, [item])
            else:
                by_key[key] = blob

    async def _fetch_own(self, by_key: dict[str, EmbeddingBlob], items: list[MediaInput]) -> None:
        """Fetches the items' keys in one round trip, letting concurrent requests for them wait on it."""
        loop = asyncio.get_running_loop()
        keys = [item.key for item in items if item.key is not None]
        futures: dict[str, asyncio.Future[EmbeddingBlob | None]] = {key: loop.create_future() for key in keys}
        self._fetching.update(futures)
        try:
            for key, blob in zip(keys, await fetch_items(self.store, keys, self.rules, items), strict=True):
                self.cache.put(key, blob)
                by_key[key] = blob
                futures[key].set_result(blob)
        finally:
            for key, future in futures.items():
                if not future.done():
                    future.set_result(None)
                if self._fetching.get(key) is future:
                    del self._fetching[key]


def _stored_once(media: list[MediaInput]) -> list[MediaInput]:
    """The items that name a stored key, each key once, by the first part that names it (the part
    its errors name), in order."""
    first: dict[str, MediaInput] = {}
    for item in media:
        if item.key is not None:
            first.setdefault(item.key, item)
    return list(first.values())


def _check_modality(item: MediaInput, blob: EmbeddingBlob, index: int) -> None:
    """An image part must get an image blob (grid t == 1) and a video part a video blob."""
    where = f"{item.modality} at {item.at}" if item.at else f"{item.modality} part {index}"
    where += f" (key {clip(item.key)!r})" if item.key is not None else " (inline)"
    if blob.modality != item.modality:
        raise InvalidEmbedding(
            f"{where} holds {blob.modality} embeddings; send them in a part of type {blob.modality}_embeds",
            param=item.param,
        )
    if item.modality == "image" and int(blob.grid_thw[0, 0]) != 1:
        raise InvalidEmbedding(f"{where} has grid t = {int(blob.grid_thw[0, 0])}; an image has t = 1", param=item.param)


def _media_uuid(item: MediaInput) -> str:
    """A stable id for an engine's prefix cache: the key names its content; inline blobs are hashed."""
    if item.key is not None:
        return item.key
    return "inline:sha256:" + hashlib.sha256(item.blob or b"").hexdigest()
