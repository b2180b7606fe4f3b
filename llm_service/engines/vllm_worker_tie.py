"""Imported by vLLM in each worker process of EngineCore, and nowhere else: importing it ties the
worker to EngineCore, its parent (shared/process_tree.py).

vLLM names this module's class in `worker_extension_cls` (set by vllm_process.py) and imports it
by name while the worker sets itself up, before the model loads; that import is the one moment
our code runs in a worker. vLLM's own pipe-based death notice reaches the worker but did not end
it: measured after a `kill -9` of EngineCore, a worker kept spinning on its shared-memory queue
for 20-40 s.
"""

from __future__ import annotations

from shared.process_tree import die_with_parent

die_with_parent()


class DiesWithEngineCore:
    """An empty worker extension: vLLM needs a class to import; the import above is the point."""
