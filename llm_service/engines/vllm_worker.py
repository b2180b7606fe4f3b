"""Our code in each worker process of vLLM's EngineCore, and nowhere else.

vLLM names this module's class in `worker_extension_cls` (set by vllm_process.py) and imports it
by name while the worker sets itself up, before the model loads; that import is the one moment
our code runs in a worker unasked. Two things happen through it:
- Importing it ties the worker to EngineCore, its parent (shared/process_tree.py). vLLM's own
  pipe-based death notice reaches the worker but did not end it: measured after a `kill -9` of
  EngineCore, a worker kept spinning on its shared-memory queue for 20-40 s.
- The class's methods become the worker's, callable from the service by `collective_rpc`. The
  service has each worker freeze its start-up heap once warmed up (shared/gc_heap.py). vLLM's GPU
  worker freezes its own after warm-up; its CPU worker does not, and there a full collection
  walked torch's, vLLM's and the model's objects: 0.3 to 0.9 s during which no request in the
  engine got a token (measured on 2 CPU cores with a gc callback in the worker, tiny checkpoints).
  And the service's engine probe ends here (VLLMEngine.probe): a worker answers it between two of
  its model steps, so a frozen worker leaves it unanswered.
"""

from __future__ import annotations

from shared.gc_heap import freeze_startup_heap
from shared.process_tree import die_with_parent

die_with_parent()


class WorkerExtension:
    """Mixed into vLLM's worker class; no state of its own."""

    def freeze_startup_heap(self) -> int:
        """Freezes this worker's heap (shared/gc_heap.py); returns how many objects it holds."""
        return freeze_startup_heap()

    def answer_probe(self) -> None:
        """Nothing: answering at all is the answer (VLLMEngine.probe)."""
