"""NetworkPolicy evaluation: the flows the settings imply are allowed, the ones isolation is for
are not, and the encoder's internet egress excludes every private and cluster range.

A flow is (source, destination, port, protocol); an endpoint is a pod (its namespace, labels and
container ports) or an address outside the cluster. Kubernetes semantics: a pod is isolated for
egress (ingress) once any policy of that type selects it, and then a flow must match a rule of
one of them; policies add up, and ipBlock rules match addresses outside the cluster only.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from deploy.lint.manifests import Doc, containers, ident, label_selector_matches, namespace, of_kind, pod_labels

# Where the policies say Prometheus and the cluster DNS run (base/network-policies.yaml).
PROMETHEUS = ("monitoring", {"app.kubernetes.io/name": "prometheus"})
KUBE_DNS = ("kube-system", {"k8s-app": "kube-dns"})
# Addresses an image URL must not reach: private (RFC 1918), CGNAT, loopback, link-local (the
# node's metadata service), multicast and reserved; IPv6 likewise; cluster ranges come on top.
NOT_PUBLIC = ("0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
              "192.168.0.0/16", "224.0.0.0/4", "240.0.0.0/4", "::1/128", "::ffff:0:0/96", "64:ff9b::/96",
              "fc00::/7", "fe80::/10", "ff00::/8")  # fmt: skip
CLUSTER_CIDRS = "vlm-encode-once/cluster-cidrs"
PUBLIC_PROBES = (("203.0.113.7", 443), ("2001:db8::7", 443))


@dataclass(frozen=True)
class Endpoint:
    name: str
    ns: str | None = None  # None: outside the cluster
    labels: dict[str, str] = field(default_factory=dict)
    ports: tuple[tuple[str, int], ...] = ()  # (name, containerPort) of its containers
    address: str | None = None


def pod(w: Doc) -> Endpoint:
    ports = tuple(
        (p.get("name", ""), p["containerPort"]) for c in containers(w, init=False) for p in c.get("ports", [])
    )
    return Endpoint(ident(w), namespace(w), pod_labels(w), ports)


def outside(address: str) -> Endpoint:
    return Endpoint(address, address=address)


def allowed(docs: list[Doc], src: Endpoint, dst: Endpoint, port: int, protocol: str = "TCP") -> bool:
    """Whether the policies let src open port/protocol on dst (both directions checked)."""
    return _admits(docs, src, dst, port, protocol, "Egress") and _admits(docs, dst, src, port, protocol, "Ingress")


def _admits(docs: list[Doc], subject: Endpoint, peer: Endpoint, port: int, protocol: str, kind: str) -> bool:
    if subject.ns is None:
        return True  # outside the cluster: no policy of ours applies
    policies = [p for p in of_kind(docs, "NetworkPolicy") if namespace(p) == subject.ns and kind in _types(p)]
    policies = [p for p in policies if _selects(p["spec"].get("podSelector", {}), subject.labels)]
    if not policies:
        return True
    key, peers_key = ("egress", "to") if kind == "Egress" else ("ingress", "from")
    target = peer if kind == "Egress" else subject  # named ports are the destination's
    return any(
        _peers_match(docs, p, rule.get(peers_key), peer) and _ports_match(rule.get("ports"), target, port, protocol)
        for p in policies for rule in p["spec"].get(key, [])
    )  # fmt: skip


def _types(policy: Doc) -> list[str]:
    spec = policy["spec"]
    return spec.get("policyTypes") or ["Ingress", *(["Egress"] if "egress" in spec else [])]


def _selects(selector: Doc, labels: dict[str, str]) -> bool:
    empty = not (selector.get("matchLabels") or selector.get("matchExpressions"))
    return empty or label_selector_matches(selector, labels)


def _namespace_labels(docs: list[Doc], ns: str) -> dict[str, str]:
    labels = {"kubernetes.io/metadata.name": ns}
    for doc in of_kind(docs, "Namespace"):
        if doc["metadata"]["name"] == ns:
            labels |= doc["metadata"].get("labels", {})
    return labels


def _peers_match(docs: list[Doc], policy: Doc, peers: list[Doc] | None, peer: Endpoint) -> bool:
    if not peers:
        return True  # no `to`/`from`: every peer
    for entry in peers:
        if "ipBlock" in entry:
            if peer.address is not None and _in_block(peer.address, entry["ipBlock"]):
                return True
            continue
        if peer.ns is None:
            continue
        ns_selector = entry.get("namespaceSelector")
        in_ns = (
            _selects(ns_selector, _namespace_labels(docs, peer.ns)) if ns_selector is not None
            else peer.ns == namespace(policy)
        )  # fmt: skip
        if in_ns and _selects(entry.get("podSelector", {}), peer.labels):
            return True
    return False


def _in_block(address: str, block: Doc) -> bool:
    ip = ipaddress.ip_address(address)
    network = ipaddress.ip_network(block["cidr"])
    if ip.version != network.version or ip not in network:
        return False
    return not any(
        ip in ipaddress.ip_network(e) for e in block.get("except", []) if ipaddress.ip_network(e).version == ip.version
    )


def _ports_match(ports: list[Doc] | None, dst: Endpoint, port: int, protocol: str) -> bool:
    if not ports:
        return True
    for entry in ports:
        if entry.get("protocol", "TCP") != protocol:
            continue
        wanted = entry.get("port")
        if wanted is None:
            return True
        if isinstance(wanted, str):
            if (wanted, port) in dst.ports:
                return True
        elif wanted <= port <= entry.get("endPort", wanted):
            return True
    return False
