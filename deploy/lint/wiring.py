"""Rules on how the objects fit together: names, selectors, Service targets, the gateway's
routing, probes and the ports they name."""

from __future__ import annotations

import json
import re
from collections import Counter

from deploy.lint.manifests import (
    Doc,
    containers,
    covered_by,
    env,
    env_value,
    ident,
    label_selector_matches,
    namespace,
    of_kind,
    pod_labels,
    selected,
    workloads,
)  # fmt: skip

# The gRPC health service name that only says "the process serves" (shared/grpc_server.py).
LIVENESS_SERVICE = "liveness"
MIN_MODEL_STARTUP_S = 300  # a model server's startup probe must allow at least this long
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
PORT_NAME = re.compile(r"(?=[a-z0-9-]*[a-z])[a-z0-9]+(-[a-z0-9]+)*")  # IANA_SVC_NAME, <= 15 chars
SERVICE_TARGET = re.compile(r"dns:///([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.cluster\.local:(\d+)")


def names(docs: list[Doc]) -> list[str]:
    """DNS-1123 object and container names, IANA port names, no duplicate objects or env vars."""
    found = []
    for (kind, ns, name), count in Counter(
        (d.get("kind"), namespace(d), d["metadata"].get("name")) for d in docs
    ).items():
        if count > 1:
            found.append(f"{kind}/{name}: defined {count} times in namespace {ns}")
    for doc in docs:
        name = doc["metadata"].get("name", "")
        label_only = doc.get("kind") in ("Service", "Namespace")
        if not (DNS_LABEL if label_only else DNS_SUBDOMAIN).fullmatch(name) or len(name) > (63 if label_only else 253):
            found.append(f"{ident(doc)}: name {name!r} is not a DNS-1123 {'label' if label_only else 'subdomain'}")
        ports = doc["spec"].get("ports", []) if doc.get("kind") == "Service" else []
        bad = [p["name"] for p in ports if not _port_name_ok(p.get("name"))]
        found += [f"{ident(doc)}: port name {name!r} is not an IANA service name" for name in bad]
    for w in workloads(docs):
        names_in_pod = [c["name"] for c in containers(w)]
        found += [f"{ident(w)}: container name {n!r} repeated" for n, k in Counter(names_in_pod).items() if k > 1]
        for c in containers(w):
            if not DNS_LABEL.fullmatch(c["name"]):
                found.append(f"{ident(w)}: container name {c['name']!r} is not a DNS-1123 label")
            bad_ports = [p["name"] for p in c.get("ports", []) if not _port_name_ok(p.get("name"))]
            found += [f"{ident(w)}/{c['name']}: port name {p!r} is not an IANA service name" for p in bad_ports]
            repeated = [n for n, k in Counter(e["name"] for e in c.get("env", [])).items() if k > 1]
            found += [f"{ident(w)}/{c['name']}: env {n} set more than once (the last one wins)" for n in repeated]
    return found


def _port_name_ok(name: str | None) -> bool:
    return name is None or (len(name) <= 15 and bool(PORT_NAME.fullmatch(name)))


def selectors(docs: list[Doc]) -> list[str]:
    """Selectors agree with pod labels; each Service/PDB selects exactly one workload; HPA targets exist."""
    found = []
    for w in workloads(docs):
        if not label_selector_matches(w["spec"].get("selector"), pod_labels(w)):
            found.append(f"{ident(w)}: spec.selector does not match its pod template labels")
    for svc in of_kind(docs, "Service"):
        if "selector" in svc["spec"]:
            count = len(selected(docs, svc, svc["spec"]["selector"]))
            if count != 1:
                found.append(f"{ident(svc)}: selector matches {count} workloads, expected exactly 1")
    covered: Counter[str] = Counter()
    for pdb in of_kind(docs, "PodDisruptionBudget"):
        matched = covered_by(docs, pdb)
        covered.update(ident(w) for w in matched)
        if len(matched) != 1:
            found.append(f"{ident(pdb)}: selector matches {len(matched)} workloads, expected exactly 1")
    found += [f"{ident(w)}: no PodDisruptionBudget covers it" for w in workloads(docs) if not covered[ident(w)]]
    for hpa in of_kind(docs, "HorizontalPodAutoscaler"):
        found += _hpa_findings(docs, hpa)
    return found


def _hpa_findings(docs: list[Doc], hpa: Doc) -> list[str]:
    ref = hpa["spec"]["scaleTargetRef"]
    targets = [
        w for w in workloads(docs)
        if (w["kind"], w["metadata"]["name"], namespace(w)) == (ref["kind"], ref["name"], namespace(hpa))
    ]  # fmt: skip
    if not targets:
        return [f"{ident(hpa)}: scaleTargetRef {ref['kind']}/{ref['name']} does not exist"]
    found = []
    if "replicas" in targets[0]["spec"]:
        found.append(f"{ident(hpa)}: {ident(targets[0])} sets spec.replicas, which resets the HPA on every apply")
    scales_on = {
        m.get("resource", {}).get("name") for m in hpa["spec"].get("metrics", []) if m.get("type") == "Resource"
    }
    for resource in scales_on:
        if any(resource not in c.get("resources", {}).get("requests", {}) for c in containers(targets[0], init=False)):
            found.append(f"{ident(hpa)}: scales on {resource} but {ident(targets[0])} does not request {resource}")
    return found


def service_targets(docs: list[Doc]) -> list[str]:
    """Every Service port's targetPort is a port the selected containers declare."""
    found = []
    for svc in of_kind(docs, "Service"):
        for w in selected(docs, svc, svc["spec"].get("selector", {})):
            declared = [p for c in containers(w, init=False) for p in c.get("ports", [])]
            for port in svc["spec"].get("ports", []):
                target = port.get("targetPort", port["port"])
                key = "name" if isinstance(target, str) else "containerPort"
                if not any(p.get(key) == target for p in declared):
                    found.append(f"{ident(svc)}: targetPort {target!r} is not a container port of {ident(w)}")
    return found


def routing(docs: list[Doc]) -> list[str]:
    """The gateway's targets name headless Services, on their ports, of the right backends."""
    found = []
    for w in workloads(docs):
        for c in containers(w, init=False):
            models, err = env_setting(docs, w, c, "GATEWAY_MODELS")
            encoder, err2 = env_setting(docs, w, c, "GATEWAY_ENCODER_TARGET")
            found += [f"{ident(w)}: {e}" for e in (err, err2) if e]
            if models is not None:
                found += _model_routes(docs, w, models)
            if encoder is not None:
                found += _target_findings(docs, w, encoder, "ENCODER_CHECKPOINT", None)
    return found


def env_setting(docs: list[Doc], w: Doc, c: Doc, name: str) -> tuple[str | None, str | None]:
    """An env var's value, following configMapKeyRef: (value, problem)."""
    entry = env(c).get(name)
    if entry is None:
        return None, None
    if "value" in entry:
        return entry["value"], None
    ref = entry.get("valueFrom", {}).get("configMapKeyRef")
    if ref is None:
        return None, f"{name} must be a value or a configMapKeyRef"
    for cm in of_kind(docs, "ConfigMap"):
        if cm["metadata"]["name"] == ref["name"] and namespace(cm) == namespace(w):
            if ref["key"] in cm.get("data", {}):
                return cm["data"][ref["key"]], None
            return None, f"{name}: ConfigMap/{ref['name']} has no key {ref['key']!r}"
    return None, f"{name}: ConfigMap/{ref['name']} does not exist"


def _model_routes(docs: list[Doc], gateway: Doc, raw: str) -> list[str]:
    try:
        models = json.loads(raw)
    except json.JSONDecodeError as error:
        return [f"{ident(gateway)}: GATEWAY_MODELS is not JSON ({error})"]
    found = []
    for model, targets in models.items():
        for target in targets or [None]:
            found += _target_findings(docs, gateway, target, "LLM_MODEL_NAME", model)
    served = {env_value(c, "LLM_MODEL_NAME"): w for w in workloads(docs) for c in containers(w, init=False)}
    unrouted = [(m, w) for m, w in served.items() if m and m not in models]
    found += [f"{ident(w)}: serves model {m!r}, which the gateway does not route" for m, w in unrouted]
    return found


def _target_findings(docs: list[Doc], gateway: Doc, target: str | None, setting: str, model: str | None) -> list[str]:
    """One gRPC target: a headless Service in the gateway's cluster, on a Service port, whose pods
    set `setting` (to `model` when given)."""
    where = f"{ident(gateway)}: target {target!r}" + (f" of model {model!r}" if model else "")
    match = SERVICE_TARGET.fullmatch(target or "")
    if not match:
        return [f"{where} is not dns:///<service>.<namespace>.svc.cluster.local:<port>"]
    name, ns, port = match.group(1), match.group(2), int(match.group(3))
    services = [s for s in of_kind(docs, "Service") if s["metadata"]["name"] == name and namespace(s) == ns]
    if not services:
        return [f"{where}: no Service {name} in namespace {ns}"]
    svc, found = services[0], []
    if svc["spec"].get("clusterIP") != "None":
        found.append(f"{where}: Service/{name} is not headless, so round robin sees one address")
    if port not in [p["port"] for p in svc["spec"].get("ports", [])]:
        found.append(f"{where}: Service/{name} has no port {port}")
    for w in selected(docs, svc, svc["spec"].get("selector", {})):
        values = {env_value(c, setting) for c in containers(w, init=False)} - {None}
        if not values or (model is not None and model not in values):
            found.append(f"{where}: {ident(w)} behind it sets {setting}={sorted(values)}")
    return found


def probes(docs: list[Doc]) -> list[str]:
    """Readiness and liveness everywhere, probe ports that exist, gRPC liveness and startup probes
    on the liveness service (not readiness), port settings that match the declared ports, and model
    servers with a startup probe long enough to load the model."""
    found = []
    for w in workloads(docs):
        for c in containers(w, init=False):
            where = f"{ident(w)}/{c['name']}"
            numbers = {p["containerPort"] for p in c.get("ports", [])}
            names_ = {p.get("name") for p in c.get("ports", [])} - {None}
            found += [f"{where}: no {kind}" for kind in ("readinessProbe", "livenessProbe") if kind not in c]
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                port = _probe_port(c.get(kind, {}))
                if port is not None and port not in numbers | names_:
                    found.append(f"{where}: {kind} port {port!r} is not a declared container port")
            for kind in ("startupProbe", "livenessProbe"):
                service = c.get(kind, {}).get("grpc", {}).get("service", "")
                if "grpc" in c.get(kind, {}) and service != LIVENESS_SERVICE:
                    found.append(
                        f"{where}: {kind} asks gRPC health service {service!r}, which follows Redis (readiness): "
                        f"an outage would restart the pod; ask service {LIVENESS_SERVICE!r}"
                    )
            for name, entry in env(c).items():
                value = entry.get("value")
                if name.endswith("_PORT") and value is not None and value.isdigit() and int(value) not in numbers:
                    found.append(f"{where}: {name}={value} but no containerPort {value} is declared")
            if any(name.endswith("_CHECKPOINT") for name in env(c)):
                budget = _startup_budget(c.get("startupProbe"))
                if budget < MIN_MODEL_STARTUP_S:
                    found.append(
                        f"{where}: loads a model but its startupProbe allows {budget}s (< {MIN_MODEL_STARTUP_S}s)"
                    )
    return found


def _probe_port(probe: Doc) -> int | str | None:
    for handler in ("grpc", "httpGet", "tcpSocket"):
        if handler in probe:
            return probe[handler].get("port")
    return None


def _startup_budget(probe: Doc | None) -> int:
    if not probe:
        return 0
    return probe.get("initialDelaySeconds", 0) + probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)
