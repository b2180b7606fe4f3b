"""Fast engine: vLLM's async engine in-process, fed with stored image and video embeddings.

vLLM brings continuous batching, the paged KV cache and prefix caching. The prompt goes to vLLM as
we render it, with one `<|image_pad|>` / `<|video_pad|>` per item; vLLM's Qwen2-VL processor
expands each pad into the item's rows. The items travel as multimodal data per modality
(`image_embeds` [rows, hidden] concatenated over the images in prompt order, `image_grid_thw`
[n, 3]; videos likewise), each with its blob key as uuid, so a second question on the same image
reuses the cached prefix. With every modality limit at 0 and `enable_mm_embeds`, vLLM builds the
vision tower on the meta device and never loads its weights: this engine only ever receives
embeddings.

Each item with a uuid goes to the engine as a file in shared memory (handoff.py) and the request
carries only its grid; an item that could not be handed off goes inline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from collections.abc import Set as AbstractSet
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase, Qwen2VLConfig
from vllm import SamplingParams as VLLMSamplingParams
from vllm.config import ECTransferConfig, LoggingConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMClientError
from vllm.inputs import TokensPrompt
from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError

from llm_service.engines.base import (
    Engine,
    EngineRequest,
    EngineShape,
    FinishReason,
    GenerationDelta,
    ModelDtype,
    SampledToken,
    SamplingParams,
    decode_text,
    eos_token_ids,
    validate_request,
)
from llm_service.engines.handoff import HandoffFiles
from llm_service.engines.handoff_connector import DIRECTORY_KEY, HandoffConnector
from llm_service.engines.vllm_process import dying_with_service
from shared.errors import InvalidInput, Unavailable
from shared.logging_setup import active_logging_config

_GIB = 1 << 30
DEFAULT_HANDOFF_BYTES = 256 * 1024 * 1024
ENGINE_DEAD = "the vLLM engine process died; this service is restarting"


class FileGone(Unavailable):
    """A handed-off file the engine needed was gone; a retry writes it again."""


class VLLMEngine(Engine):
    def __init__(
        self, engine: AsyncLLM, tokenizer: PreTrainedTokenizerBase, config: Qwen2VLConfig, eos_ids: set[int],
        handoff: HandoffFiles,
    ) -> None:  # fmt: skip
        self.engine: AsyncLLM | None = engine  # None once closed
        self.handoff = handoff
        self.tokenizer = tokenizer
        self.shape = EngineShape.of(config)
        self.hidden_size: int = self.shape.hidden_size
        # vLLM's own figure (it refuses to start when max_model_len exceeds what the model allows).
        self.max_model_len: int = engine.model_config.max_model_len
        self.eos_ids = eos_ids
        scheduler = engine.vllm_config.scheduler_config
        # A step computes at most vLLM's token budget, prompt chunks and decodes together; without
        # chunked prefill a whole prompt is one step (vLLM then refuses a budget under max_model_len).
        budget = scheduler.max_num_batched_tokens
        self._step_tokens = budget if scheduler.enable_chunked_prefill else max(budget, self.max_model_len)

    @classmethod
    def load(
        cls, checkpoint: str, dtype: ModelDtype = "float32", max_model_len: int = 4096, kv_cache_gib: float | None = None,
        enforce_eager: bool = False, handoff_bytes: int = DEFAULT_HANDOFF_BYTES,
    ) -> VLLMEngine:  # fmt: skip
        """Starts vLLM's engine process for a local checkpoint (tens of seconds).

        dtype: "float32" is token-exact with the transformers engine; "bfloat16" is faster and drifts.
        max_model_len: prompt plus completion tokens, per request.
        kv_cache_gib: KV cache size; None leaves vLLM's default (on CPU, VLLM_CPU_KVCACHE_SPACE or
        a share of RAM).
        enforce_eager: skip torch.compile (and its warm-up): the engine starts in seconds, not a
        minute, and decodes more slowly; for quick checks.
        handoff_bytes: most bytes of embeddings kept as files for the engine (handoff.py); 0 sends
        every item inline.
        """
        path = Path(checkpoint)
        tokenizer = AutoTokenizer.from_pretrained(path)
        config = AutoConfig.from_pretrained(path)
        eos_ids = _eos_ids(path, config, tokenizer)
        handoff = HandoffFiles(getattr(torch, dtype), handoff_bytes)
        args = AsyncEngineArgs(
            model=str(path),
            dtype=dtype,
            max_model_len=max_model_len,
            enable_prefix_caching=True,
            enable_mm_embeds=True,
            # 0 per modality + enable_mm_embeds: embeddings only, vision tower weights never loaded.
            limit_mm_per_prompt={"image": 0, "video": 0},
            # Every sampling knob comes from the request: the checkpoint's generation_config.json
            # (Qwen2-VL ships top_k=1, repetition_penalty=1.05) must not leak in. Eos ids are set
            # explicitly per request instead.
            generation_config="vllm",
            kv_cache_memory_bytes=None if kv_cache_gib is None else int(kv_cache_gib * _GIB),
            enforce_eager=enforce_eager,
            # vLLM's default, pinned: the transformers engine reports the same kind (logits.py).
            logprobs_mode="raw_logprobs",
            logging_config=_service_logging(),
            # A consumer of encoder outputs: ours, handed off as files (handoff_connector.py).
            ec_transfer_config=ECTransferConfig(
                ec_connector=HandoffConnector.__name__,
                ec_role="ec_consumer",
                ec_connector_module_path=HandoffConnector.__module__,
                ec_connector_extra_config={DIRECTORY_KEY: str(handoff.directory)},
            ),  # fmt: skip
        )
        try:
            # AsyncLLM.from_engine_args, with an executor that ties EngineCore to this process.
            vllm_config = args.create_engine_config()
            with dying_with_service(vllm_config) as executor_class:
                engine = AsyncLLM(
                    vllm_config=vllm_config, executor_class=executor_class, log_requests=args.enable_log_requests,
                    log_stats=not args.disable_log_stats,
                )  # fmt: skip
        except BaseException:
            handoff.close()
            raise
        finally:  # every engine process has read it by now (or none will start)
            if args.logging_config is not None and args.logging_config.pylogging_config_file:
                Path(args.logging_config.pylogging_config_file).unlink(missing_ok=True)
        return cls(engine, tokenizer, config, eos_ids, handoff)

    def close(self) -> None:
        """Stops the engine process; blocks for a few seconds. Idempotent."""
        engine, self.engine = self.engine, None
        try:
            if engine is not None:
                engine.shutdown()
        finally:
            self.handoff.close()
        # Dropping the last reference now lets AsyncLLM.__del__ (which shuts down again) run while
        # the interpreter is whole, not at exit, where it fails on torn-down modules.
        del engine

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)  # shutdown waits on the engine process; keep the loop free

    def num_unfinished_requests(self) -> int:
        return self._live().get_num_unfinished_requests()

    def failure(self) -> str | None:
        # `errored`: vLLM's process monitor saw EngineCore exit, or its output handler failed.
        return ENGINE_DEAD if self.engine is None or self.engine.errored else None

    @property
    def longest_step_tokens(self) -> int:
        return self._step_tokens

    async def probe(self) -> None:
        """A no-op on each of EngineCore's workers (vllm_worker.py), sent as vLLM's utility call
        `collective_rpc`. EngineCore's input thread queues utility calls for its busy loop, which
        handles them between two engine steps (vLLM's EngineCoreProc._process_input_queue), as it
        does requests and aborts; its executor then hands the no-op to each worker, on the queue
        that carries the workers' model steps, and EngineCore answers once every worker has. So a
        frozen or hung EngineCore or worker leaves the probe unanswered, idle or busy. The no-op
        touches no request, cache or scheduler state; it delays the next step by one round trip
        to the workers (0.6 ms idle, tiny checkpoint, 2 CPU cores). vLLM's own `is_sleeping`, which
        EngineCore answers alone, kept answering with its worker frozen."""
        await self._live().collective_rpc("answer_probe")

    async def freeze_startup_heaps(self) -> int:
        """Each of EngineCore's workers freezes its heap (vllm_worker.py); EngineCore freezes its
        own once started (vLLM's EngineCoreProc)."""
        frozen: list[int] = await self._live().collective_rpc("freeze_startup_heap")
        return sum(frozen)

    def _live(self) -> AsyncLLM:
        """The engine; Unavailable once it is closed or its process died."""
        if self.engine is None or self.engine.errored:
            raise Unavailable(ENGINE_DEAD)
        return self.engine

    async def generate(self, request: EngineRequest) -> AsyncIterator[GenerationDelta]:
        self._validate(request)
        engine = self._live()
        # Client ids may repeat; vLLM needs one id per live request to route outputs and aborts.
        request_id = f"{request.request_id}-{uuid.uuid4().hex}"
        request, held = self._hand_off(request)
        deltas = _DeltaBuilder(self.tokenizer, self.eos_ids, request.prompt_tokens, request.sampling.logprobs)
        finished = False
        stream: AsyncGenerator[RequestOutput, None] | None = None
        try:
            prompt = self.vllm_prompt(request, handed_off=set(held))
            stream = engine.generate(prompt, self.vllm_sampling_params(request.sampling), request_id)
            async for output in stream:
                finished = output.finished
                delta = deltas.build(output.outputs[0], finished)
                if delta is not None:
                    yield delta
        except VLLMClientError as error:  # rejected at admission; the service checks length before this
            raise InvalidInput(str(error)) from None
        except EngineDeadError:  # EngineCore died (OOM killer, crash): not this request's fault
            raise Unavailable(ENGINE_DEAD) from None
        except FileGone:
            for item_uuid in held:
                self.handoff.forget(item_uuid)
            raise
        finally:
            try:
                if stream is not None:
                    await stream.aclose()
                if not finished and self.failure() is None:  # consumer gone or error: free the KV blocks now
                    # A dead engine holds no blocks; its death (between the check and the abort)
                    # must not replace the error or cancellation that ends this call.
                    with contextlib.suppress(EngineDeadError):
                        await engine.abort(request_id)
            finally:  # even when cancelled mid-abort: the files' grace covers a step still under way
                for item_uuid in held:
                    self.handoff.release(item_uuid)

    def _hand_off(self, request: EngineRequest) -> tuple[EngineRequest, list[str]]:
        """Holds a file for each item it can (their uuids, to release). An item that goes inline
        although a file exists under its uuid (other rows: a rewritten blob) loses its uuid:
        vLLM would load that file for it."""
        held: list[str] = []
        media = []
        for item in request.media:
            if item.uuid is not None and self.handoff.hold(item.uuid, item.embeds):
                held.append(item.uuid)
            elif item.uuid is not None and self.handoff.has(item.uuid):
                item = replace(item, uuid=None)  # vLLM hashes the rows instead
            media.append(item)
        return replace(request, media=media), held

    def vllm_prompt(self, request: EngineRequest, handed_off: AbstractSet[str] = frozenset()) -> TokensPrompt:
        """The request as vLLM takes it: the prompt with one pad per item, grids as multimodal
        data, each item's uuid (its blob key) for the prefix cache and the handed-off file; the
        rows too, for a modality with an item not in `handed_off`."""
        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))
        data: dict[str, dict[str, torch.Tensor]] = {}
        uuids: dict[str, list[str | None]] = {}
        for modality in ("image", "video"):
            items = [item for item in request.media if item.modality == modality]
            if not items:
                continue
            # vLLM fills a modality's pads in order, splitting the rows per item by the grid; it
            # casts them to the model dtype.
            data[modality] = {f"{modality}_grid_thw": torch.cat([item.grid_thw for item in items]).to(torch.int64)}
            if not all(item.uuid in handed_off for item in items):  # vLLM takes a modality's rows all or none
                data[modality][f"{modality}_embeds"] = _concat_rows([item.embeds for item in items])
            uuids[modality] = [item.uuid for item in items]  # None: vLLM hashes that item's rows
        if data:
            prompt["multi_modal_data"] = data
            prompt["multi_modal_uuids"] = uuids
        return prompt

    def vllm_sampling_params(self, sampling: SamplingParams) -> VLLMSamplingParams:
        return VLLMSamplingParams(
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=1.0 if sampling.greedy else sampling.top_p,
            top_k=0,  # disabled, as in the transformers engine
            seed=sampling.seed,
            stop=list(sampling.stop),
            stop_token_ids=sorted(self.eos_ids),
            output_kind=RequestOutputKind.DELTA,
            skip_special_tokens=True,
            # k: the sampled token's logprob plus the top k, as vLLM's default logprobs_mode
            # "raw_logprobs" (log_softmax before penalties and temperature).
            logprobs=sampling.logprobs,
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty,
        )

    def _validate(self, request: EngineRequest) -> None:
        validate_request(request, self.shape)


class _DeltaBuilder:
    """Turns vLLM's delta outputs into GenerationDeltas that read like the transformers engine's.

    One difference is evened out: at the end, vLLM drops an incomplete UTF-8 tail while the
    transformers engine flushes it as U+FFFD; the full decode's tail is appended here, unless a
    stop string ended the text.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, eos_ids: set[int], prompt_tokens: int, top_k: int | None
    ) -> None:
        self._tokenizer = tokenizer
        self._eos_ids = eos_ids
        self._prompt_tokens = prompt_tokens
        self._top_k = top_k or 0
        self._ids: list[int] = []
        self._text = ""

    def build(self, piece: CompletionOutput, finished: bool) -> GenerationDelta | None:
        self._ids += piece.token_ids
        text = piece.text
        if finished and not isinstance(piece.stop_reason, str):  # str: a stop string matched
            text += self._tail(self._text + text)
        self._text += text
        if not (piece.token_ids or text or finished):
            return None
        reason = _finish_reason(piece.finish_reason) if finished else None
        logprobs = _token_logprobs(piece, self._top_k)
        return GenerationDelta(text, list(piece.token_ids), reason, self._prompt_tokens, len(self._ids), logprobs)

    def _tail(self, emitted: str) -> str:
        kept = [t for t in self._ids if t not in self._eos_ids]
        full = decode_text(self._tokenizer, kept)
        return full[len(emitted) :] if full.startswith(emitted) else ""


def _token_logprobs(piece: CompletionOutput, top_k: int) -> list[SampledToken]:
    """One entry per token of the delta. vLLM's dict per position holds the top k (ranks 1..k)
    plus the sampled token, an extra entry only when it ranks below k."""
    positions = piece.logprobs
    if positions is None:
        return []
    entries = []
    for token, position in zip(piece.token_ids, positions, strict=True):
        assert position is not None  # only prompt positions may lack logprobs
        entries.append(SampledToken(token, position[token].logprob, _top(position, top_k)))
    return entries


def _top(position: dict[int, Logprob], top_k: int) -> list[tuple[int, float]]:
    ranked = sorted((entry.rank, token, entry.logprob) for token, entry in position.items() if entry.rank is not None)
    return [(token, logprob) for rank, token, logprob in ranked if rank <= top_k]


def _concat_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(tensors) (a copy: vLLM never sees, so never writes, the cached blobs' memory),
    made by numpy on this thread. torch.cat runs on torch's OpenMP pool, and with the cores busy
    waking it costs milliseconds per request: a 0.8 MB bfloat16 copy measured 1.9 ms at p50 and
    7.9 ms at p90 with both cores of this machine loaded, against 0.016 ms here."""
    rows = [t.detach().cpu().contiguous() for t in tensors]
    if len({t.dtype for t in rows}) > 1:  # blobs of different dtypes: let torch promote them
        return torch.cat(rows)
    as_bytes = np.concatenate([t.view(torch.uint8).numpy() for t in rows])  # numpy has no bfloat16
    return torch.from_numpy(as_bytes).view(rows[0].dtype)


def _finish_reason(reason: str | None) -> FinishReason:
    if reason in ("stop", "length"):
        return reason  # type: ignore[return-value]
    if reason == "error":  # vLLM's scheduler failed it: an item's handed-off file was gone (handoff_connector.py)
        raise FileGone("the engine could not load this request's embeddings; retry the request")
    raise RuntimeError(f"vLLM ended the generation with finish reason {reason!r}")


def _service_logging() -> LoggingConfig | None:
    """vLLM's logging set up as the service's (JSON lines with the request id, shared.logging_setup),
    in this process and in the engine processes it spawns, which never run our __main__: vLLM
    applies a logging config file in each. Left to vLLM, it gives its "vllm" logger a text handler
    of its own and stops it propagating. None (vLLM's default) where the service did not configure
    logging (a library use, a test)."""
    config = active_logging_config()
    if config is None:
        return None
    with tempfile.NamedTemporaryFile("w", prefix="vllm-logging-", suffix=".json", delete=False) as file:
        json.dump(config, file)
    return LoggingConfig(pylogging_config_file=file.name)


def _eos_ids(path: Path, config: Qwen2VLConfig, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Same set as the transformers engine (which reads the checkpoint's generation config)."""
    try:
        configured = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:  # no generation_config.json: transformers derives one from the model config
        configured = GenerationConfig.from_model_config(config).eos_token_id
    return eos_token_ids(configured, tokenizer)
