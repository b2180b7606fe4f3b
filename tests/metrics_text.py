"""Reading a service's Prometheus /metrics in tests."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

# The labels of the LLM service's Generate RPC in the gRPC server metrics.
GENERATE_LABELS = {"grpc_service": "llm.v1.LLMService", "grpc_method": "/llm.v1.LLMService/Generate"}


def scrape(url: str) -> str:
    return httpx.get(url, timeout=5).text


def metric_sum(metrics_text: str, sample: str, **labels: str) -> float:
    """Sum of the samples called `sample` whose labels include `labels` (0 when there is none)."""
    return sum(
        found.value
        for family in text_string_to_metric_families(metrics_text)
        for found in family.samples
        if found.name == sample and labels.items() <= found.labels.items()
    )


def exported(metrics_text: str) -> set[str]:
    """The names of every sample in the text."""
    return {found.name for family in text_string_to_metric_families(metrics_text) for found in family.samples}
