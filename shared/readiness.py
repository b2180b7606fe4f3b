"""Readiness that follows a service's dependencies.

A service that is up but cannot reach Redis (or whose engine died) answers every request that
needs it with 503; reporting SERVING meanwhile keeps traffic coming to it. So readiness is not
set once at start: each dependency gets a check, every check runs about once a second, and the
service reports SERVING only while all of them pass. It comes back by itself when they do: no
restart, and a service whose Redis is down at start still starts (NOT_SERVING until it answers).

Checks run concurrently, each bounded by `timeout_s`; a check that raises or overruns counts as
failing. A service that was SERVING goes NOT_SERVING only when a dependency has failed DOWN_AFTER
checks in a row: on a busy node one PING can take longer than its timeout (measured on 2 loaded
cores: Redis answered redis-cli's PINGs in up to 0.49 s, and the services' 0.5 s socket timeout
turned single slow PINGs into NOT_SERVING), and the gateway's /readyz follows the encoder's
readiness, so one slow PING could take the whole gateway out of its Service. Coming back takes
one passing round. A dead engine needs no patience: the LLM service's own watch on it sets
NOT_SERVING at once (shared/grpc_server.py serve_until_signal). Changes are logged once,
naming the failing dependencies.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping

logger = logging.getLogger(__name__)

Check = Callable[[], Awaitable[bool]]  # True while the dependency answers
Report = Callable[[bool], Awaitable[None]]

INTERVAL_S = 1.0
TIMEOUT_S = 1.0
DOWN_AFTER = 3  # failed checks in a row before a dependency that answered counts as down


async def failing(checks: Mapping[str, Check], timeout_s: float = TIMEOUT_S) -> list[str]:
    """Names of the checks that do not pass now."""
    results = await asyncio.gather(*(_passes(name, check, timeout_s) for name, check in checks.items()))
    return [name for name, ok in zip(checks, results, strict=True) if not ok]


async def follow(checks: Mapping[str, Check], report: Report, ready: bool) -> None:
    """Re-checks every INTERVAL_S and reports each change of readiness, until cancelled.
    `ready`: what was reported last."""
    misses = dict.fromkeys(checks, 0)  # failed checks in a row, per dependency
    while True:
        await asyncio.sleep(INTERVAL_S)
        failed = set(await failing(checks))
        misses = {name: misses[name] + 1 if name in failed else 0 for name in checks}
        down = [name for name, count in misses.items() if count >= (DOWN_AFTER if ready else 1)]
        if (not down) != ready:
            ready = not down
            await report(ready)
            log_change(down)


def log_change(down: list[str]) -> None:
    if down:
        logger.warning("not ready: %s not answering; reporting NOT_SERVING", ", ".join(down))
    else:
        logger.info("ready: every dependency answers; reporting SERVING")


async def _passes(name: str, check: Check, timeout_s: float) -> bool:
    try:
        async with asyncio.timeout(timeout_s):
            return await check()
    except TimeoutError:
        return False
    except Exception:  # a broken check must not stop readiness from being followed
        logger.exception("readiness check %r failed", name)
        return False
