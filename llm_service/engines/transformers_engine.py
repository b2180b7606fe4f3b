"""Exact, slow engine: `Qwen2VLForConditionalGeneration.generate` fed with stored image embeddings.

The prompt arrives with one pad per image or video (the form vLLM takes); this engine expands each
pad into one per embedding row (`expand_pads`), scatters the rows into those positions of the
prompt embeddings, and still gives the model `input_ids`, `mm_token_type_ids` and the grids, from
which it derives the M-RoPE positions itself. In float32 this yields the same tokens as
`generate(pixel_values=...)`. One generation runs at a time, on one worker thread: the model and
its cached rope deltas are not re-entrant.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import torch
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    LogitsProcessorList,
    PreTrainedTokenizerBase,
    Qwen2VLForConditionalGeneration,
    StoppingCriteria,
    StoppingCriteriaList,
)

from llm_service.engines.base import (
    Engine,
    EngineRequest,
    EngineShape,
    FinishReason,
    GenerationDelta,
    MediaItem,
    SampledToken,
    SamplingParams,
    decode_text,
    eos_token_ids,
    sub_config,
    validate_request,
)
from llm_service.engines.logits import Penalties, RawLogprobs
from shared.blob import Modality

_DONE = object()  # end-of-stream marker on the queue
_PROBE_POLL_S = 0.05  # how often a probe looks for the generation thread's next emit
Emit = Callable[[object], None]
# mm_token_type_ids as Qwen2-VL's processor makes them: 0 text, 1 image, 2 video.
_MM_TOKEN_TYPES: dict[Modality, int] = {"image": 1, "video": 2}


def expand_pads(request: EngineRequest, shape: EngineShape) -> list[int]:
    """The prompt as the language model reads it: the pad of media item i repeated rows(i) times.
    The request must have passed validate_request (one pad per item, in order)."""
    pads = shape.pads
    rows = iter(item.rows for item in request.media)
    expanded: list[int] = []
    for token in request.prompt_token_ids:
        expanded.extend([token] * next(rows) if token in pads else [token])
    return expanded


class IncrementalDetokenizer:
    """Turns tokens into text pieces that never change once emitted.

    Held back: an incomplete UTF-8 tail (decoded as U+FFFD) and the last len(longest stop)-1
    characters, which could still become the start of a stop string.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: list[str], eos_ids: set[int]) -> None:
        self._tokenizer = tokenizer
        self._stop = stop
        self._eos_ids = eos_ids
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._ids: list[int] = []
        self._emitted = 0
        self.stop_hit = False

    def push(self, token_id: int) -> str:
        if self.stop_hit or token_id in self._eos_ids:
            return ""
        self._ids.append(token_id)
        text = self._decode()
        cut = self._find_stop(text)
        if cut is not None:
            self.stop_hit = True
            return self._take(text[:cut])
        stable = text.rstrip("\ufffd")
        return self._take(stable[: len(stable) - self._holdback])

    def flush(self) -> str:
        return "" if self.stop_hit else self._take(self._decode())

    def _decode(self) -> str:
        return decode_text(self._tokenizer, self._ids)

    def _find_stop(self, text: str) -> int | None:
        hits = [i for i in (text.find(s, max(0, self._emitted - len(s))) for s in self._stop) if i >= 0]
        return min(hits) if hits else None

    def _take(self, text: str) -> str:
        piece = text[self._emitted :]
        self._emitted = max(self._emitted, len(text))
        return piece


class _TokenObserver(StoppingCriteria):
    """Sees each new token, emits its delta, and halts generation on a stop string or cancel.

    A stopping criterion rather than a streamer: in transformers 5.19 `streamer.put` runs after
    the stopping criteria, too late to halt on the token that completes a stop string.
    """

    def __init__(
        self, detok: IncrementalDetokenizer, request: EngineRequest, eos_ids: set[int], emit: Emit,
        cancel: threading.Event, raw: RawLogprobs | None,
    ) -> None:  # fmt: skip
        self.detok = detok
        self.raw = raw
        self.top_k = request.sampling.logprobs or 0
        self.eos_ids = eos_ids
        self.max_tokens = request.sampling.max_tokens
        self.prompt_tokens = request.prompt_tokens
        self.emit = emit
        self.cancel = cancel
        self.completion_tokens = 0
        self.finished = False

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: object) -> torch.BoolTensor:
        token = int(input_ids[0, -1])
        self.completion_tokens += 1
        text = self.detok.push(token)
        reason = self._finish_reason(token)
        if reason is not None:
            text += self.detok.flush()
            self.finished = True
        logprobs = [self._logprob(token)] if self.raw is not None else []
        self.emit(GenerationDelta(text, [token], reason, self.prompt_tokens, self.completion_tokens, logprobs))
        stop = self.detok.stop_hit or self.cancel.is_set()
        return cast(
            torch.BoolTensor, torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)
        )

    def _logprob(self, token: int) -> SampledToken:
        assert self.raw is not None and self.raw.row is not None  # set by this step's processors
        row = self.raw.row
        values, ids = row.topk(self.top_k)
        return SampledToken(token, float(row[token]), list(zip(ids.tolist(), values.tolist(), strict=True)))

    def _finish_reason(self, token: int) -> FinishReason | None:
        if self.detok.stop_hit or token in self.eos_ids:
            return "stop"
        if self.completion_tokens >= self.max_tokens:
            return "length"
        return None


class TransformersEngine(Engine):
    def __init__(
        self, model: Qwen2VLForConditionalGeneration, tokenizer: PreTrainedTokenizerBase, max_model_len: int = 4096
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.shape = EngineShape.of(model.config)
        self.hidden_size: int = self.shape.hidden_size
        # The service's setting, as vLLM takes it, but never past the positions the model was made for.
        positions = sub_config(model.config, "text_config").max_position_embeddings
        self.max_model_len: int = min(max_model_len, positions)
        self.eos_ids = eos_token_ids(model.generation_config.eos_token_id, tokenizer)
        self.pad_token_id: int = _pad_id(model, tokenizer, self.eos_ids)
        # One worker thread serialises generations without a lock that a cancelled consumer could leak.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="transformers-engine")
        # That thread's heartbeat, for `probe`: whether it runs a generation, and how often it has
        # emitted (a token, an error, an end). Only the thread writes them.
        self._generating = False
        self._emitted = 0

    @classmethod
    def load(
        cls, checkpoint: str, device: str = "cpu", dtype: torch.dtype = torch.float32, max_model_len: int = 4096
    ) -> TransformersEngine:
        path = Path(checkpoint)
        model = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=dtype).eval()
        # This service never sees pixels: drop the vision tower before moving to the device, so
        # its weights never occupy device memory and are freed from host memory.
        model.model.visual = None
        return cls(model.to(device), AutoTokenizer.from_pretrained(path), max_model_len)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def failure(self) -> str | None:
        return None  # in-process: it fails with the service, never without it

    async def freeze_startup_heaps(self) -> int:
        return 0  # in-process: its heap is the service's, which the service freezes itself

    async def probe(self) -> None:
        """Answered once the generation thread emits again (a token, an end), or at once while it
        runs no generation: a generation hung on its device leaves the probe unanswered, as it
        leaves its tokens. Not queued behind the generations on the thread: that would wait for a
        whole generation, however slowly its client reads."""
        emitted = self._emitted
        while self._generating and self._emitted == emitted:
            await asyncio.sleep(_PROBE_POLL_S)

    async def generate(self, request: EngineRequest) -> AsyncIterator[GenerationDelta]:
        self._validate(request)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[object] = asyncio.Queue()
        cancel = threading.Event()

        def emit(item: object) -> None:
            self._emitted += 1
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # event loop closed: nobody is listening any more
                cancel.set()

        loop.run_in_executor(self._executor, self._run, request, emit, cancel)
        try:
            while (item := await queue.get()) is not _DONE:
                if isinstance(item, BaseException):
                    raise item
                assert isinstance(item, GenerationDelta)
                yield item
        finally:
            cancel.set()  # consumer gone or stream done: stop the worker at its next token

    def _run(self, request: EngineRequest, emit: Emit, cancel: threading.Event) -> None:
        """Worker thread: one blocking generate, deltas pushed through emit."""
        self._generating = True
        try:
            if cancel.is_set():  # cancelled while queued behind another generation
                return
            detok = IncrementalDetokenizer(self.tokenizer, request.sampling.stop, self.eos_ids)
            raw = RawLogprobs() if request.sampling.logprobs is not None else None
            observer = _TokenObserver(detok, request, self.eos_ids, emit, cancel, raw)
            self._generate_blocking(request, observer, self._processors(request, raw))
            if not observer.finished and not cancel.is_set():
                raise RuntimeError(f"generation for {request.request_id} ended without a finish reason")
        except BaseException as exc:  # handed to the consumer, which re-raises it
            emit(exc)
        finally:
            self._generating = False
            emit(_DONE)

    def _processors(self, request: EngineRequest, raw: RawLogprobs | None) -> LogitsProcessorList:
        """Ours, in the order logits.py explains: raw logprobs first, then penalties."""
        sampling = request.sampling
        processors = LogitsProcessorList([raw] if raw is not None else [])
        if sampling.penalized:
            processors.append(Penalties(request.prompt_tokens, sampling.presence_penalty, sampling.frequency_penalty))
        return processors

    def _generate_blocking(
        self, request: EngineRequest, observer: _TokenObserver, processors: LogitsProcessorList
    ) -> None:
        device = self.model.device
        input_ids = torch.tensor([expand_pads(request, self.shape)], dtype=torch.long, device=device)
        with torch.inference_mode():
            inputs_embeds = self.model.get_input_embeddings()(input_ids)
            inputs_embeds, mm_kwargs = self._scatter_media(input_ids, inputs_embeds, request.media)
            model_inputs: dict[str, Any] = {
                "input_ids": input_ids,
                "inputs_embeds": inputs_embeds,
                "attention_mask": torch.ones_like(input_ids),
                **mm_kwargs,
            }
            if request.sampling.seed is not None:
                torch.manual_seed(request.sampling.seed)  # safe: only this thread generates
            # type: ignore: transformers types generate's self as a protocol its models do not declare.
            self.model.generate(  # type: ignore[misc]
                generation_config=self._generation_config(request.sampling),
                stopping_criteria=StoppingCriteriaList([observer]),
                logits_processor=processors,
                **model_inputs,
            )

    def _scatter_media(
        self, input_ids: torch.Tensor, inputs_embeds: torch.Tensor, media: list[MediaItem]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Puts each image's and video's rows into its pad positions (the expanded prompt's).
        Returns the embeddings and the kwargs from which the model derives M-RoPE positions:
        mm_token_type_ids and the [n, 3] grids of each modality, in prompt order."""
        token_types = torch.zeros_like(input_ids)
        mm_kwargs: dict[str, torch.Tensor] = {}
        for modality, type_id in _MM_TOKEN_TYPES.items():
            items = [item for item in media if item.modality == modality]
            if not items:
                continue
            is_pad = input_ids == self.shape.pad_of(modality)
            rows = torch.cat([item.embeds for item in items]).to(inputs_embeds.device, inputs_embeds.dtype)
            inputs_embeds = inputs_embeds.masked_scatter(is_pad.unsqueeze(-1), rows)
            token_types[is_pad] = type_id
            grid = torch.cat([item.grid_thw for item in items])
            mm_kwargs[f"{modality}_grid_thw"] = grid.to(inputs_embeds.device, torch.int64)
        if mm_kwargs:
            mm_kwargs["mm_token_type_ids"] = token_types
        return inputs_embeds, mm_kwargs

    def _generation_config(self, sampling: SamplingParams) -> GenerationConfig:
        # Every knob set explicitly: unset ones would be filled from the checkpoint's
        # generation_config.json (Qwen2-VL ships top_k=1, repetition_penalty=1.05).
        return GenerationConfig(
            max_new_tokens=sampling.max_tokens,
            do_sample=not sampling.greedy,
            temperature=1.0 if sampling.greedy else sampling.temperature,
            top_p=1.0 if sampling.greedy else sampling.top_p,
            top_k=None if sampling.greedy else 0,  # 0 disables top-k; None keeps greedy warning-free
            repetition_penalty=1.0,
            eos_token_id=sorted(self.eos_ids),
            pad_token_id=self.pad_token_id,
        )

    def _validate(self, request: EngineRequest) -> None:
        validate_request(request, self.shape)


def _pad_id(model: Qwen2VLForConditionalGeneration, tokenizer: PreTrainedTokenizerBase, eos_ids: set[int]) -> int:
    for candidate in (model.generation_config.pad_token_id, tokenizer.pad_token_id):
        if candidate is not None:
            return candidate
    return min(eos_ids)
