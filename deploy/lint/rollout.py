"""Shutdown timing: a rollout, a scale-in or an eviction lets every call in flight run to its
deadline before the kubelet's SIGKILL.

A pod being deleted keeps receiving calls during its preStop pause (the endpoints and DNS are
still catching up), so a call may start just before SIGTERM. Then:
- an encoder or LLM service stops taking calls and gives those in flight *_GRACE_S seconds
  (shared/service_server.py); one backend call lasts at most the gateway's deadline
  (GATEWAY_REQUEST_TIMEOUT_S), so *_GRACE_S must be at least that deadline;
- the gateway (uvicorn) stops taking requests and waits, without limit, for those in flight; one
  chat request makes its encode calls, then its Generate stream, each bounded by the deadline.
terminationGracePeriodSeconds must exceed preStop plus that drain, or the SIGKILL cuts the stream.
"""

from __future__ import annotations

import re

from deploy.lint.manifests import Doc, containers, env, env_value, ident, pod_spec, workloads

DEFAULT_GRACE_S = 10.0  # *_GRACE_S default of both gRPC services (shared/settings.py)
DEFAULT_DEADLINE_S = 300.0  # GATEWAY_REQUEST_TIMEOUT_S default (gateway/settings.py)
GRPC_SERVER_PREFIXES = ("ENCODER_", "LLM_")
# Backend calls one chat request makes one after the other: its encodes (in parallel), then Generate.
GATEWAY_PHASES = 2


def termination(docs: list[Doc]) -> list[str]:
    """Serving containers pause in preStop; gRPC services drain for at least the gateway's
    deadline; the grace period outlasts pause + drain (the gateway's drain: its phases)."""
    deadline = gateway_deadline(docs)
    found = []
    for w in workloads(docs):
        grace_period = pod_spec(w).get("terminationGracePeriodSeconds", 30)
        for c in containers(w, init=False):
            if not c.get("ports"):
                continue
            pre_stop = c.get("lifecycle", {}).get("preStop")
            if not pre_stop:
                found.append(f"{ident(w)}/{c['name']}: serves ports but has no preStop pause")
                continue
            drain = _drain_seconds(c)
            if _is_grpc_server(c) and drain < deadline:
                found.append(
                    f"{ident(w)}/{c['name']}: drain {drain:g}s is below the gateway's deadline {deadline:g}s: "
                    "a rollout cuts calls that may still run"
                )
            needed = _pre_stop_seconds(pre_stop) + drain
            if grace_period <= needed:
                found.append(
                    f"{ident(w)}: terminationGracePeriodSeconds {grace_period} <= preStop + drain ({needed:g}s) of {c['name']}"
                )
    return found


def gateway_deadline(docs: list[Doc]) -> float:
    """The longest GATEWAY_REQUEST_TIMEOUT_S any gateway container runs with."""
    values = [
        float(env_value(c, "GATEWAY_REQUEST_TIMEOUT_S") or DEFAULT_DEADLINE_S)
        for w in workloads(docs) for c in containers(w, init=False) if _is_gateway(c)
    ]  # fmt: skip
    return max(values, default=DEFAULT_DEADLINE_S)


def _is_gateway(container: Doc) -> bool:
    return any(name.startswith("GATEWAY_") for name in env(container))


def _is_grpc_server(container: Doc) -> bool:
    return any(name.startswith(GRPC_SERVER_PREFIXES) for name in env(container))


def _pre_stop_seconds(pre_stop: Doc) -> float:
    if "sleep" in pre_stop:
        return float(pre_stop["sleep"]["seconds"])
    command = " ".join(pre_stop.get("exec", {}).get("command", []))
    match = re.search(r"\bsleep\s+(\d+(?:\.\d+)?)", command)
    return float(match.group(1)) if match else 0.0


def _drain_seconds(container: Doc) -> float:
    if _is_gateway(container):
        return GATEWAY_PHASES * float(env_value(container, "GATEWAY_REQUEST_TIMEOUT_S") or DEFAULT_DEADLINE_S)
    graces = [float(e["value"]) for n, e in env(container).items() if n.endswith("_GRACE_S") and "value" in e]
    if graces:
        return max(graces)
    return DEFAULT_GRACE_S if _is_grpc_server(container) else 0.0
