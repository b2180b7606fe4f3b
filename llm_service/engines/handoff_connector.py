"""vLLM EC connector (consumer only) for the embeddings our service hands off as files (handoff.py).

vLLM builds one in its scheduler and one in each worker, from the module path in the engine's
`ec_transfer_config`; `handoff_dir` in its extra config names the directory. The scheduler side
says which items have a file and schedules their load where the worker's encoder cache misses;
the worker side loads them into that cache. A request that names an item with neither inline
rows nor a file is failed by vLLM's scheduler (take_unavailable_requests), never run: run, it
would kill the engine, as a stock consumer dies on a missing item.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors.torch import load_file
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase, ECConnectorMetadata, ECConnectorRole

from llm_service.engines.handoff import TENSOR_NAME, handoff_path

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

DIRECTORY_KEY = "handoff_dir"


@dataclass
class HandoffLoads(ECConnectorMetadata):
    """Scheduler to worker, each step: the items to load from their files."""

    identifiers: list[str] = field(default_factory=list)


class HandoffConnector(ECConnectorBase):
    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        assert vllm_config.ec_transfer_config is not None  # the base class refuses to start without one
        self._directory = Path(vllm_config.ec_transfer_config.get_from_extra_config(DIRECTORY_KEY, ""))
        self._to_load: list[str] = []
        self._unavailable: set[str] = set()

    # Scheduler side

    def has_cache_item(self, identifier: str) -> bool:
        return handoff_path(self._directory, identifier).exists()

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """False (and the request failed next) where an item still to be computed came without
        rows and has no file."""
        for feature in request.mm_features:
            position = feature.mm_position
            still_needed = position.offset + position.length > num_computed_tokens
            inline = feature.data is not None and f"{feature.modality}_embeds" in feature.data
            if still_needed and not inline and not self.has_cache_item(feature.identifier):
                self._unavailable.add(request.request_id)
                return False
        return True

    def take_unavailable_requests(self) -> set[str]:
        unavailable, self._unavailable = self._unavailable, set()
        return unavailable

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        identifier = request.mm_features[index].identifier
        if self.has_cache_item(identifier):
            self._to_load.append(identifier)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        loads, self._to_load = HandoffLoads(self._to_load), []
        return loads

    # Worker side

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        from vllm.platforms import current_platform

        metadata = self._get_connector_metadata()
        assert isinstance(metadata, HandoffLoads)
        device = current_platform.device_type
        if current_platform.is_cuda_alike():
            device = f"{device}:{current_platform.current_device()}"
        for identifier in metadata.identifiers:
            if identifier not in encoder_cache:
                encoder_cache[identifier] = load_file(handoff_path(self._directory, identifier), device=device)[
                    TENSOR_NAME
                ]

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        return None  # a consumer stores nothing
