"""A few generations through the engine before the service reports SERVING.

vLLM compiles some of its sampling code on first use, whatever `enforce_eager` says: the rank of
each sampled token among the logprobs (`batched_count_greater_than`, torch.compile with inductor)
is compiled by the first request that asks for logprobs, and compiled again for the first batch
of more than one such request, when torch marks the batch size dynamic. On a machine whose
compile cache is empty (a new pod) the two took 8.9 s on 2 CPU cores (on a GPU, inductor builds
Triton kernels), so the first users asking for logprobs waited that long for a token, and with a
tight STALL_S the progress watch took the compiling engine for a hung one and restarted the
service. Here the service pays it once, at start-up, before anyone waits. The three warm-up
requests show in vLLM's own request counters; ours never see them.

Warmed up, the engine is also timed (`time_prefill`), where the service sizes its stall limit to
the machine (llm_service/server.py): the time of a prefill, per prompt token.
"""

from __future__ import annotations

import asyncio
import logging
import time

from llm_service.engines.base import Engine, EngineRequest, SamplingParams
from shared.sampling_limits import MAX_TOP_LOGPROBS

logger = logging.getLogger(__name__)

# Each knob a request may turn, so that every sampling path runs once: greedy and seeded
# sampling, top_p, both penalties, logprobs with the most alternatives allowed.
_GREEDY = SamplingParams(max_tokens=2, logprobs=MAX_TOP_LOGPROBS)
_SAMPLED = SamplingParams(
    max_tokens=2, temperature=1.0, top_p=0.9, seed=0, logprobs=MAX_TOP_LOGPROBS, presence_penalty=0.5,
    frequency_penalty=0.5,
)  # fmt: skip
# The prefill timed for the stall limit: long enough that the fixed cost of a request is a small
# part of it, short enough to cost little at start-up.
PREFILL_TOKENS = 256
_ONE_TOKEN = SamplingParams(max_tokens=1)


async def warm_up(engine: Engine) -> None:
    """Runs one request alone, then two at once (a batch of two), and logs the time it took."""
    started = time.perf_counter()
    prompt = engine.tokenizer.encode("Warm up.")
    await _generate(engine, EngineRequest("warm-up-alone", prompt, sampling=_GREEDY))
    await asyncio.gather(
        _generate(engine, EngineRequest("warm-up-batch-0", prompt, sampling=_GREEDY)),
        _generate(engine, EngineRequest("warm-up-batch-1", prompt, sampling=_SAMPLED)),
    )
    logger.info("engine warmed up in %.2fs (sampling paths compiled before serving)", time.perf_counter() - started)


async def time_prefill(engine: Engine) -> float:
    """Seconds per prompt token of a prefill of PREFILL_TOKENS: the quicker of two, each of its own
    prompt (the second must not find the first in vLLM's prefix cache), and the quicker because a
    step of a new shape may pay one-time set-up. One token each, so that the prefill is nearly all
    of the time; the rest (sampling one token, the round trip to the engine) counts as prefill,
    erring toward a longer limit."""
    tokens = min(PREFILL_TOKENS, engine.max_model_len - 1)
    times = []
    for index, word in enumerate(("prefill", "measure")):
        prompt = engine.tokenizer.encode(f" {word}" * tokens)[:tokens]  # each word one token or more
        started = time.perf_counter()
        await _generate(engine, EngineRequest(f"warm-up-prefill-{index}", prompt, sampling=_ONE_TOKEN))
        times.append(time.perf_counter() - started)
    return min(times) / tokens


async def _generate(engine: Engine, request: EngineRequest) -> None:
    async for _ in engine.generate(request):
        pass
