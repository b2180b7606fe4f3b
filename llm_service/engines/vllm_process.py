"""vLLM's engine processes die with the service (shared/process_tree.py explains the mechanism).

vLLM runs its engine as an EngineCore process, started by multiprocessing `spawn` (vLLM forces
spawn on CPU): a fresh interpreter that never imports our `__main__` (multiprocessing skips a
package's `__main__.py`), so no import-time hook of ours runs there. What the child does load is
the executor class the service hands to AsyncLLM: it travels to EngineCore by reference and is
constructed there first thing, before the model loads. So the service gives vLLM the executor
vLLM would have chosen, subclassed to call `die_with_parent()` on construction. EngineCore's
workers are tied to EngineCore the same way, from the one module of ours vLLM imports in them
(vllm_worker_tie.py); a worker thus dies with EngineCore, and EngineCore with the service.

Executors that run no EngineCore process of their own (ray, an external launcher) are left as
they are; `die_with_parent` is a no-op in a process that multiprocessing did not start.
"""

from __future__ import annotations

from vllm.config import VllmConfig
from vllm.v1.executor.abstract import Executor
from vllm.v1.executor.multiproc_executor import MultiprocExecutor
from vllm.v1.executor.uniproc_executor import UniProcExecutor

from shared.process_tree import die_with_parent


class MultiprocExecutorDyingWithService(MultiprocExecutor):
    """vLLM's "mp" executor (the CPU default; workers in their own processes)."""

    def _init_executor(self) -> None:
        die_with_parent()  # runs in EngineCore, before it starts its workers
        super()._init_executor()


class UniProcExecutorDyingWithService(UniProcExecutor):
    """vLLM's "uni" executor (one GPU: the model runs inside EngineCore)."""

    def _init_executor(self) -> None:
        die_with_parent()
        super()._init_executor()


_DYING_WITH_SERVICE: dict[type[Executor], type[Executor]] = {
    MultiprocExecutor: MultiprocExecutorDyingWithService,
    UniProcExecutor: UniProcExecutorDyingWithService,
}


def dying_with_service(config: VllmConfig) -> type[Executor]:
    """The executor class for AsyncLLM: the one vLLM chose for `config`, made to tie EngineCore
    to this process. Also names the worker extension that ties each worker to EngineCore."""
    if not config.parallel_config.worker_extension_cls:
        config.parallel_config.worker_extension_cls = "llm_service.engines.vllm_worker_tie.DiesWithEngineCore"
    chosen = Executor.get_class(config)
    return _DYING_WITH_SERVICE.get(chosen, chosen)
