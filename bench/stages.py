"""Histograms read from the services' own /metrics. Where our path spends a request's time before
its first token: the gateway's `gateway_request_stage_seconds` and each LLM service's
`llm_request_stage_seconds` (mean per request, ms, since the services started); and any one
histogram's running totals (the encoder's `encoder_forward_seconds` for scenario 4)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

STAGE_METRICS = ("gateway_request_stage_seconds", "llm_request_stage_seconds")


def _sums_and_counts(url: str, names: tuple[str, ...]) -> dict[tuple[str, str | None], list[float]]:
    """{(histogram name, its `stage` label or None): [sum, count]} at `url`, for each of `names`,
    summed over the other labels."""
    totals: dict[tuple[str, str | None], list[float]] = {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        if family.name not in names:
            continue
        for sample in family.samples:
            column = {f"{family.name}_sum": 0, f"{family.name}_count": 1}.get(sample.name)
            if column is not None:
                totals.setdefault((family.name, sample.labels.get("stage")), [0.0, 0.0])[column] += sample.value
    return totals


def stage_means_ms(metrics_urls: list[str]) -> dict[str, float]:
    """{"<metric prefix>:<stage>": mean ms} over every URL's samples (summed across services)."""
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for url in metrics_urls:
        for (name, stage), (total, count) in _sums_and_counts(url, STAGE_METRICS).items():
            label = f"{name.split('_')[0]}:{stage}"
            sums[label] = sums.get(label, 0.0) + total
            counts[label] = counts.get(label, 0.0) + count
    return {label: 1e3 * sums[label] / counts[label] for label in sorted(sums) if counts.get(label)}


def histogram_totals(url: str, name: str) -> tuple[float, float]:
    """(sum, count) of the histogram `name` at `url`, over all its labels."""
    parts = _sums_and_counts(url, (name,)).values()
    return sum((part[0] for part in parts), 0.0), sum((part[1] for part in parts), 0.0)
