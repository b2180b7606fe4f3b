"""Prometheus metrics of the gateway, served at GET /metrics."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

HTTP_REQUESTS = Counter(
    "gateway_http_requests_total", "HTTP requests answered, by route and status.", ["route", "status"]
)
# The route of a request the HTTP protocol answered (431, 408) before the app saw its head.
UNREAD_ROUTE = "unread"
HTTP_SECONDS = Histogram(
    "gateway_http_request_seconds", "Time to the response head (streams: to the first event), by route.", ["route"],
    buckets=LATENCY_BUCKETS,
)  # fmt: skip
# The name is older than encodes taking slots too; kept, as dashboards and alerts query it.
IN_FLIGHT = Gauge(
    "gateway_chat_in_flight",
    "Chat completions and encodes being served now (the slots of GATEWAY_MAX_CONCURRENT_REQUESTS).",
)
TTFT_SECONDS = Histogram(
    "gateway_ttft_seconds",
    "Time from request to the first generated token of a streamed chat, by model.",
    ["model"],
    buckets=LATENCY_BUCKETS,
)
TOKENS = Counter("gateway_completion_tokens_total", "Tokens generated, by model.", ["model"])
TOKEN_SECONDS = Histogram(
    "gateway_time_per_output_token_seconds",
    "Mean time per generated token after the first, per streamed chat, by model.",
    ["model"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
)
# A chat that is not streamed has no first token to time: its LLM services send each choice whole,
# as one message (llm_request_stage_seconds{stage="first_token"} still times their engines).
# The gateway's own share of a chat's time: prepare (encode or look up every image and video, build
# the messages) and relay (turning each choice's chunks into the response and sending them, summed
# over a completed choice); the LLM service times its stages in llm_request_stage_seconds.
STAGE_SECONDS = Histogram(
    "gateway_request_stage_seconds", "Time of each stage of a chat completion in the gateway, by stage.", ["stage"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)  # fmt: skip
