"""Where our path spends a request's time before its first token, read from the services' own
/metrics: the gateway's `gateway_request_stage_seconds` and each LLM service's
`llm_request_stage_seconds` (mean per request, ms, since the services started)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

STAGE_METRICS = ("gateway_request_stage_seconds", "llm_request_stage_seconds")


def stage_means_ms(metrics_urls: list[str]) -> dict[str, float]:
    """{"<metric prefix>:<stage>": mean ms} over every URL's samples (summed across services)."""
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for url in metrics_urls:
        for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
            if family.name not in STAGE_METRICS:
                continue
            for sample in family.samples:
                label = f"{family.name.split('_')[0]}:{sample.labels.get('stage')}"
                if sample.name.endswith("_sum"):
                    sums[label] = sums.get(label, 0.0) + sample.value
                elif sample.name.endswith("_count"):
                    counts[label] = counts.get(label, 0.0) + sample.value
    return {label: 1e3 * sums[label] / counts[label] for label in sorted(sums) if counts.get(label)}


def histogram_totals(url: str, name: str) -> tuple[float, float]:
    """(sum, count) of the histogram `name` at `url`, over all its labels."""
    total = count = 0.0
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        if family.name != name:
            continue
        for sample in family.samples:
            if sample.name == f"{name}_sum":
                total += sample.value
            elif sample.name == f"{name}_count":
                count += sample.value
    return total, count
