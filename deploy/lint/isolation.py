"""The isolation rule: NetworkPolicies (evaluated by network.py) deny by default, allow each flow
the settings imply (gateway -> routed gRPC targets, Redis clients -> the Redis Service, Prometheus
-> scrape ports, every pod -> DNS), keep strangers out, and let only the encoder out to public
addresses, never to a private, link-local or cluster range."""

from __future__ import annotations

import ipaddress
import json
from urllib.parse import urlsplit

from deploy.lint.manifests import Doc, containers, env, ident, namespace, of_kind, selected, workloads
from deploy.lint.network import (
    CLUSTER_CIDRS,
    KUBE_DNS,
    NOT_PUBLIC,
    PROMETHEUS,
    PUBLIC_PROBES,
    Endpoint,
    allowed,
    outside,
    pod,
)
from deploy.lint.scope import ENV_REFERENCE
from deploy.lint.wiring import SERVICE_TARGET, env_setting

PUBLIC_ENV = "GATEWAY_"  # the gateway serves clients from anywhere; no other pod may be reached so
PRIVATE_PROBES = ("10.0.0.1", "172.16.0.1", "192.168.0.1", "169.254.169.254", "100.64.0.1", "fd00::1")


def network_policies(docs: list[Doc]) -> list[str]:
    """Default deny in every namespace with workloads; the needed flows allowed, the rest denied."""
    found = []
    for ns in sorted({namespace(w) for w in workloads(docs)}):
        if not any(_denies_all(p) for p in of_kind(docs, "NetworkPolicy") if namespace(p) == ns):
            found.append(
                f"namespace {ns}: no default-deny NetworkPolicy (podSelector {{}}, Ingress and Egress, no rules)"
            )
    for src, dst, port, protocol, why in _needed_flows(docs):
        if not allowed(docs, src, dst, port, protocol):
            found.append(f"{src.name} -> {dst.name}:{port}/{protocol} ({why}) is not allowed by the NetworkPolicies")
    for w in workloads(docs):
        found += _isolation_findings(docs, w)
    for policy in of_kind(docs, "NetworkPolicy"):
        found += _public_block_findings(policy)
    return found


def _denies_all(policy: Doc) -> bool:
    spec = policy["spec"]
    selector = spec.get("podSelector", {})
    everyone = not (selector.get("matchLabels") or selector.get("matchExpressions"))
    types = set(spec.get("policyTypes", []))
    return everyone and types >= {"Ingress", "Egress"} and not spec.get("ingress") and not spec.get("egress")


Flow = tuple[Endpoint, Endpoint, int, str, str]


def _needed_flows(docs: list[Doc]) -> list[Flow]:
    flows: list[Flow] = []
    dns = Endpoint("kube-dns", KUBE_DNS[0], KUBE_DNS[1], (("dns", 53),))
    prometheus = Endpoint("prometheus", PROMETHEUS[0], PROMETHEUS[1])
    for w in workloads(docs):
        flows.append((pod(w), dns, 53, "UDP", "DNS"))
        scrape = w["spec"]["template"].get("metadata", {}).get("annotations", {}).get("prometheus.io/port")
        if scrape:
            flows.append((prometheus, pod(w), int(scrape), "TCP", "metrics"))
        for c in containers(w, init=False):
            for name in ("GATEWAY_ENCODER_TARGET", "GATEWAY_MODELS"):
                value, _ = env_setting(docs, w, c, name)
                for target in _targets(name, value):
                    match = SERVICE_TARGET.fullmatch(target)
                    if match:
                        flows += _to_service(docs, w, match.group(2), match.group(1), int(match.group(3)), name)
            for name, entry in env(c).items():
                if name.endswith("_REDIS_URL") and "value" in entry:
                    parts = urlsplit(ENV_REFERENCE.sub("x", entry["value"]))
                    service, _, rest = (parts.hostname or "").partition(".")
                    flows += _to_service(docs, w, rest.split(".")[0], service, parts.port or 6379, name)
    return flows


def _targets(name: str, value: str | None) -> list[str]:
    if value is None:
        return []
    if name == "GATEWAY_MODELS":
        try:
            return [t for targets in json.loads(value).values() for t in targets or []]
        except (json.JSONDecodeError, AttributeError):
            return []  # the routing rule reports it
    return [value]


def _to_service(docs: list[Doc], src: Doc, ns: str, name: str, port: int, why: str) -> list[Flow]:
    """src -> each pod behind Service ns/name's port, on the container port it forwards to."""
    services = [s for s in of_kind(docs, "Service") if s["metadata"]["name"] == name and namespace(s) == ns]
    flows: list[Flow] = []
    for svc in services:
        for entry in (p for p in svc["spec"].get("ports", []) if p["port"] == port):
            target = entry.get("targetPort", port)
            for w in selected(docs, svc, svc["spec"].get("selector", {})):
                dst = pod(w)
                numbers = [n for n_name, n in dst.ports if target in (n_name, n)]
                flows += [(pod(src), dst, n, entry.get("protocol", "TCP"), why) for n in numbers[:1]]
    return flows


def _isolation_findings(docs: list[Doc], w: Doc) -> list[str]:
    """Strangers (any pod of another namespace, an unlabelled pod of this one) reach only the
    gateway; only the encoder reaches public addresses; nothing reaches private ones on 80/443."""
    me, found = pod(w), []
    is_gateway = any(n.startswith(PUBLIC_ENV) for c in containers(w, init=False) for n in env(c))
    is_encoder = any(n.startswith("ENCODER_") for c in containers(w, init=False) for n in env(c))
    strangers = (Endpoint("a pod of namespace elsewhere", "elsewhere"), Endpoint("an unlabelled pod", me.ns))
    for stranger in strangers:
        for port_name, number in me.ports:
            if not is_gateway and allowed(docs, stranger, me, number):
                found.append(f"{ident(w)}: {stranger.name} can open port {port_name or number}")
    for address, port in PUBLIC_PROBES:
        if allowed(docs, me, outside(address), port) != is_encoder:
            verb = "cannot reach" if is_encoder else "can reach"
            found.append(f"{ident(w)}: {verb} the public address {address}:{port}")
    for address in PRIVATE_PROBES:
        for port in (80, 443):
            if allowed(docs, me, outside(address), port):
                found.append(f"{ident(w)}: can reach the non-public address {address}:{port}")
    return found


def _public_block_findings(policy: Doc) -> list[str]:
    """An ipBlock over the whole internet excepts every non-public range and the cluster's own."""
    cluster = [c for c in policy["metadata"].get("annotations", {}).get(CLUSTER_CIDRS, "").split(",") if c]
    found = []
    for rule in policy["spec"].get("egress", []):
        for peer in rule.get("to", []):
            block = peer.get("ipBlock")
            if not block or ipaddress.ip_network(block["cidr"]).prefixlen != 0:
                continue
            if not cluster and ipaddress.ip_network(block["cidr"]).version == 4:
                found.append(f"{ident(policy)}: allows the internet but has no {CLUSTER_CIDRS} annotation")
            excepts = [ipaddress.ip_network(e) for e in block.get("except", [])]
            for needed in (*NOT_PUBLIC, *cluster):
                net = ipaddress.ip_network(needed)
                if net.version == ipaddress.ip_network(block["cidr"]).version and not any(
                    e.version == net.version and net.subnet_of(e)
                    for e in excepts  # type: ignore[arg-type]
                ):
                    found.append(f"{ident(policy)}: ipBlock {block['cidr']} does not except {needed}")
    return found
