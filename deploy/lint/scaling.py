"""Rules on autoscaling and monitoring: each model server scales on its own queue through one
KEDA ScaledObject whose query names a Service that selects it and that Prometheus scrapes; each
scraped pod is scraped exactly once; GPU pools spread over nodes."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from deploy.lint.manifests import (
    Doc,
    containers,
    env,
    ident,
    label_selector_matches,
    namespace,
    of_kind,
    pod_labels,
    pod_spec,
    selected,
    workloads,
)

MODEL_SERVER_PREFIXES = ("ENCODER_", "LLM_")
HOSTNAME = "kubernetes.io/hostname"
QUERY_LABEL = re.compile(r'\b(namespace|service)="([^"]*)"')


def autoscaling(docs: list[Doc]) -> list[str]:
    """ScaledObjects target an existing workload that sets no replicas, with 1 <= min <= max, and
    Prometheus queries that select the target's own Service in its namespace; one autoscaler per
    workload; every model server has one."""
    found, scaled = [], []
    for so in of_kind(docs, "ScaledObject"):
        ref = so["spec"].get("scaleTargetRef", {})
        kind = ref.get("kind", "Deployment")
        targets = [w for w in workloads(docs) if (w["kind"], w["metadata"]["name"], namespace(w)) ==
                   (kind, ref.get("name"), namespace(so))]  # fmt: skip
        if not targets:
            found.append(f"{ident(so)}: scaleTargetRef {kind}/{ref.get('name')} does not exist")
            continue
        target = targets[0]
        scaled.append(ident(target))
        if "replicas" in target["spec"]:
            found.append(f"{ident(so)}: {ident(target)} sets spec.replicas, which resets the scaler on every apply")
        low, high = so["spec"].get("minReplicaCount", 0), so["spec"].get("maxReplicaCount", 100)
        if not 1 <= low <= high:
            found.append(f"{ident(so)}: replicas {low}..{high}; need 1 <= min <= max (the gateway has no activator)")
        for trigger in so["spec"].get("triggers", []):
            if trigger.get("type") == "prometheus":
                found += _query_findings(docs, so, target, trigger.get("metadata", {}))
    for hpa in of_kind(docs, "HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        scaled.append(f"{ref['kind']}/{ref['name']}")
    found += [
        f"{w}: {scaled.count(w)} autoscalers; they would fight" for w in sorted(set(scaled)) if scaled.count(w) > 1
    ]
    for w in workloads(docs):
        serves_model = any(n.startswith(MODEL_SERVER_PREFIXES) for c in containers(w, init=False) for n in env(c))
        if serves_model and ident(w) not in scaled:
            found.append(f"{ident(w)}: a model server with no ScaledObject")
    return found


def _query_findings(docs: list[Doc], so: Doc, target: Doc, meta: Doc) -> list[str]:
    where = f"{ident(so)}: query {meta.get('query')!r}"
    labels = dict(QUERY_LABEL.findall(meta.get("query", "")))
    found = []
    if not meta.get("serverAddress"):
        found.append(f"{ident(so)}: prometheus trigger without serverAddress")
    try:
        if Decimal(str(meta.get("threshold", "0"))) <= 0:
            found.append(f"{ident(so)}: threshold {meta.get('threshold')!r} is not positive")
    except InvalidOperation:
        found.append(f"{ident(so)}: threshold {meta.get('threshold')!r} is not a number")
    if labels.get("namespace") != namespace(so):
        found.append(f'{where} does not select namespace="{namespace(so)}"')
    services = [s for s in of_kind(docs, "Service")
                if s["metadata"]["name"] == labels.get("service") and namespace(s) == namespace(so)]  # fmt: skip
    if not services:
        return [*found, f'{where} selects no Service of the namespace (service="...")']
    if target not in selected(docs, services[0], services[0]["spec"].get("selector", {})):
        found.append(f"{where}: Service/{labels['service']} does not select {ident(target)}")
    if not _monitors_of_service(docs, services[0]):
        found.append(f"{where}: no ServiceMonitor scrapes Service/{labels['service']}, so the series has no such label")
    return found


def _monitors_of_service(docs: list[Doc], svc: Doc) -> list[tuple[Doc, Doc]]:
    """(ServiceMonitor, endpoint) pairs that scrape svc."""
    pairs = []
    for sm in of_kind(docs, "ServiceMonitor"):
        names = sm["spec"].get("namespaceSelector", {}).get("matchNames", [namespace(sm)])
        if namespace(svc) in names and label_selector_matches(
            sm["spec"].get("selector"), svc["metadata"].get("labels", {})
        ):
            ports = {p.get("name") for p in svc["spec"].get("ports", [])}
            pairs += [(sm, e) for e in sm["spec"].get("endpoints", []) if e.get("port") in ports]
    return pairs


def monitoring(docs: list[Doc]) -> list[str]:
    """Each pod that serves metrics (a prometheus.io/port annotation) is scraped on that port
    exactly once, through a ServiceMonitor or a PodMonitor."""
    found = []
    for w in workloads(docs):
        port = w["spec"]["template"].get("metadata", {}).get("annotations", {}).get("prometheus.io/port")
        if port is None:
            continue
        scrapes = _scraped_ports(docs, w)
        if scrapes.count(int(port)) != 1:
            found.append(f"{ident(w)}: metrics port {port} is scraped {scrapes.count(int(port))} times, expected once")
    return found


def _scraped_ports(docs: list[Doc], w: Doc) -> list[int]:
    declared = {p.get("name"): p["containerPort"] for c in containers(w, init=False) for p in c.get("ports", [])}
    numbers = set(declared.values())
    ports = []
    for svc in of_kind(docs, "Service"):
        if w not in selected(docs, svc, svc["spec"].get("selector", {})):
            continue
        by_name = {p.get("name"): p.get("targetPort", p["port"]) for p in svc["spec"].get("ports", [])}
        for _, endpoint in _monitors_of_service(docs, svc):
            target = by_name[endpoint["port"]]
            ports.append(declared.get(target, 0) if isinstance(target, str) else target if target in numbers else 0)
    for pm in of_kind(docs, "PodMonitor"):
        if namespace(pm) == namespace(w) and label_selector_matches(pm["spec"].get("selector"), pod_labels(w)):
            ports += [declared.get(e.get("port"), 0) for e in pm["spec"].get("podMetricsEndpoints", [])]
    return ports


def spread(docs: list[Doc]) -> list[str]:
    """Workloads holding GPUs spread their pods over nodes (a hostname topology spread constraint
    whose selector, with matchLabelKeys, takes this workload's pods and no other's)."""
    found = []
    for w in workloads(docs):
        limits = [r for c in containers(w) for r in c.get("resources", {}).get("limits", {})]
        if not any(r.endswith("/gpu") for r in limits):
            continue
        constraints = [t for t in pod_spec(w).get("topologySpreadConstraints", []) if t.get("topologyKey") == HOSTNAME]
        if not any(_spreads_only(docs, w, t) for t in constraints):
            found.append(f"{ident(w)}: holds GPUs but no {HOSTNAME} topologySpreadConstraint selects its pods alone")
    return found


def _spreads_only(docs: list[Doc], w: Doc, constraint: Doc) -> bool:
    labels = pod_labels(w)
    selector = dict(constraint.get("labelSelector", {}).get("matchLabels", {}))
    selector |= {k: labels[k] for k in constraint.get("matchLabelKeys", []) if k in labels}
    return bool(selector) and selector.items() <= labels.items() and selected(docs, w, selector) == [w]
