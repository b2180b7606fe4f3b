"""Rules on where objects land and what the configuration points at: every namespaced object
names a namespace the overlay renders, env references resolve, and every Redis host in the
settings is a Service the overlay renders, on one of its ports (the gRPC targets are the
routing rule's)."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from deploy.lint.manifests import Doc, containers, env, ident, of_kind, workloads

# Kinds the API server keeps outside any namespace; everything else must say where it goes,
# or `kubectl apply -k` puts it in the caller's current namespace (usually `default`).
CLUSTER_SCOPED = frozenset({
    "Namespace", "Node", "PersistentVolume", "StorageClass", "PriorityClass", "RuntimeClass",
    "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "ValidatingWebhookConfiguration",
    "MutatingWebhookConfiguration", "APIService", "IngressClass", "CSIDriver", "ClusterTriggerAuthentication",
})  # fmt: skip
CLUSTER_DOMAIN = ".svc.cluster.local"
# $(NAME) in an env value is expanded by the kubelet from an earlier env var of the container.
ENV_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def namespaces(docs: list[Doc]) -> list[str]:
    """Every namespaced object sets metadata.namespace, to a Namespace the overlay renders."""
    rendered = {d["metadata"]["name"] for d in of_kind(docs, "Namespace")}
    found = []
    for doc in docs:
        if doc.get("kind") in CLUSTER_SCOPED:
            continue
        ns = doc.get("metadata", {}).get("namespace")
        if not ns:
            found.append(f"{ident(doc)}: no metadata.namespace; `kubectl apply -k` would put it in `default`")
        elif rendered and ns not in rendered:
            found.append(f"{ident(doc)}: namespace {ns!r} is not one the overlay renders ({sorted(rendered)})")
    return found


def env_references(docs: list[Doc]) -> list[str]:
    """A $(NAME) in an env value names an env var defined above it in the same container, and one
    in command or args an env var of the container: otherwise the kubelet leaves the text as is
    (a Redis URL whose password is literally "$(REDIS_PASSWORD)")."""
    found = []
    for w in workloads(docs):
        for c in containers(w):
            where, defined = f"{ident(w)}/{c['name']}", []
            for entry in c.get("env", []):
                missing = [n for n in ENV_REFERENCE.findall(str(entry.get("value", ""))) if n not in defined]
                found += [f"{where}: {entry['name']} refers to $({n}), not defined above it" for n in missing]
                defined.append(entry["name"])
            words = " ".join(str(a) for a in (*c.get("command", []), *c.get("args", [])))
            found += [f"{where}: command refers to $({n}), not an env var" for n in ENV_REFERENCE.findall(words)
                      if n not in defined]  # fmt: skip
    return found


def store_targets(docs: list[Doc]) -> list[str]:
    """Each *_REDIS_URL given as a value names a Service the overlay renders, on a port it serves:
    <service>.<namespace>.svc.cluster.local:<port>. URLs from a Secret (prod) are not visible here."""
    found = []
    for w in workloads(docs):
        for c in containers(w, init=False):
            for name, entry in env(c).items():
                if name.endswith("_REDIS_URL") and "value" in entry:
                    found += _store_findings(docs, f"{ident(w)}/{c['name']}: {name}", entry["value"])
    return found


def _store_findings(docs: list[Doc], where: str, url: str) -> list[str]:
    parts = urlsplit(ENV_REFERENCE.sub("x", url))
    host, port = parts.hostname or "", parts.port or 6379
    if not host.endswith(CLUSTER_DOMAIN) or host.count(".") != 4:
        return [f"{where}: host {host!r} is not <service>.<namespace>{CLUSTER_DOMAIN}"]
    service, ns = host.split(".")[:2]
    matches = [
        s for s in of_kind(docs, "Service")
        if s["metadata"]["name"] == service and s.get("metadata", {}).get("namespace") == ns
    ]  # fmt: skip
    if not matches:
        return [f"{where}: no Service {service} in namespace {ns} is rendered"]
    if port not in [p["port"] for p in matches[0]["spec"].get("ports", [])]:
        return [f"{where}: Service/{service} has no port {port}"]
    return []
