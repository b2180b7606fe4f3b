"""vLLM's engine processes die with the service (shared/process_tree.py explains the mechanism).

vLLM runs its engine as an EngineCore process, started by multiprocessing `spawn` (vLLM forces
spawn on CPU): a fresh interpreter that never imports our `__main__` (multiprocessing skips a
package's `__main__.py`). What the child does load is the executor class the service hands to
AsyncLLM: it travels to EngineCore by reference, among the process's arguments, so EngineCore
imports this module when it unpickles them, before vLLM's code runs. So the service gives vLLM
the executor vLLM would have chosen, subclassed only to bring this module along, and the module
ties EngineCore to the service at import.

At import, not when the executor is built: between the two, EngineCore performs a start-up
handshake with the service, and it waits for that handshake forever. A service stopped during
those seconds of start-up (a SIGTERM while its engine loads) left an EngineCore behind, waiting.
At import, multiprocessing has not yet told the child who its parent is (it does so when the
process starts its target), so the service names itself in the environment its engine processes
inherit (`ENGINE_PARENT_PID`), and the parent check against that pid catches a service that died
before the tie.

EngineCore's workers are tied to EngineCore the same way, from the one module of ours vLLM
imports in them (vllm_worker.py); a worker thus dies with EngineCore, and EngineCore with the
service.

Executors that run no EngineCore process of their own (ray, an external launcher) are left as
they are.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from vllm.config import VllmConfig
from vllm.v1.executor.abstract import Executor
from vllm.v1.executor.multiproc_executor import MultiprocExecutor
from vllm.v1.executor.uniproc_executor import UniProcExecutor

from shared.process_tree import die_with_parent

# Not a setting: how the service tells the engine processes it spawns its pid (see above).
ENGINE_PARENT_PID = "LLM_SERVICE_ENGINE_PARENT_PID"


def _tie_to_the_service() -> None:
    """Ties this process to the service when it is one of the service's engine processes."""
    parent = os.environ.get(ENGINE_PARENT_PID)
    if parent is None or int(parent) == os.getpid():  # the service itself
        return
    die_with_parent(int(parent))
    os.environ[ENGINE_PARENT_PID] = str(os.getpid())  # what this process spawns belongs to it


_tie_to_the_service()


class MultiprocExecutorDyingWithService(MultiprocExecutor):
    """vLLM's "mp" executor (the CPU default; workers in their own processes)."""


class UniProcExecutorDyingWithService(UniProcExecutor):
    """vLLM's "uni" executor (one GPU: the model runs inside EngineCore)."""


_DYING_WITH_SERVICE: dict[type[Executor], type[Executor]] = {
    MultiprocExecutor: MultiprocExecutorDyingWithService,
    UniProcExecutor: UniProcExecutorDyingWithService,
}


@contextmanager
def dying_with_service(config: VllmConfig) -> Iterator[type[Executor]]:
    """The executor class for the AsyncLLM built in this block: the one vLLM chose for `config`,
    made to tie EngineCore to this process. Also names the worker extension that ties each worker
    to EngineCore. The service's pid is in the environment only during the block, while the
    engine processes start: no other process this one starts may take it for its parent."""
    if not config.parallel_config.worker_extension_cls:
        config.parallel_config.worker_extension_cls = "llm_service.engines.vllm_worker.WorkerExtension"
    chosen = Executor.get_class(config)
    os.environ[ENGINE_PARENT_PID] = str(os.getpid())
    try:
        yield _DYING_WITH_SERVICE.get(chosen, chosen)
    finally:
        os.environ.pop(ENGINE_PARENT_PID, None)
