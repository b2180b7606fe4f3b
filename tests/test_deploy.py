"""The Kubernetes deployment (deploy/): every overlay renders with `kubectl kustomize`, passes the
API schemas strictly (kubernetes-validate) and the semantic lint (deploy/lint); dev and prod
differ as documented; adding a fine-tune is one step; and every lint rule fails on a manifest
broken the way it guards against."""

from __future__ import annotations

import copy
import functools
import json
import re
import shutil
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from deploy.add_finetune import add_finetune, finetune_kustomization
from deploy.lint import RULES, lint, render
from deploy.lint.crds import crd_errors, is_custom
from deploy.lint.manifests import containers, env, parse_quantity, workloads

# Starts processes of its own (see the tiers in tests/conftest.py).
pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
OVERLAYS = ("dev", "prod")
OLDEST_KUBERNETES = "1.30"  # native gRPC probes and the preStop sleep action
FINETUNES = ("ft-a", "ft-b")
Doc = dict[str, Any]


@functools.cache
def _render_cached(path: Path) -> tuple[Doc, ...]:
    return tuple(render(path))


def rendered(path: Path) -> list[Doc]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: cannot render the Kustomize overlays")
    pytest.importorskip("yaml", reason="PyYAML parses the rendered manifests")
    return copy.deepcopy(list(_render_cached(path)))


def _by(docs: list[Doc], kind: str, name: str) -> Doc:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def _secret_refs(docs: list[Doc]) -> list[Doc]:
    return [e["valueFrom"]["secretKeyRef"] for w in workloads(docs) for c in containers(w)
            for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})]  # fmt: skip


# --- the overlays ------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_passes_the_kubernetes_schemas_strictly(overlay: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    docs = [doc for doc in rendered(DEPLOY / "overlays" / overlay) if not is_custom(doc)]
    errors = []
    for version in (OLDEST_KUBERNETES, kubernetes_validate.latest_version()):
        for doc in docs:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as error:
                where = f"{doc['kind']}/{doc['metadata']['name']} ({version})"
                errors.append(f"{where}: {list(error.path)}: {error.message}")
            except kubernetes_validate.SchemaNotFoundError as error:
                errors.append(error.message)
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_custom_resources_pass_their_vendored_schemas(overlay: str) -> None:
    """KEDA and Prometheus Operator kinds, which kubernetes-validate has no schema for."""
    pytest.importorskip("jsonschema", reason="jsonschema checks the vendored CRD schemas")
    custom = [doc for doc in rendered(DEPLOY / "overlays" / overlay) if is_custom(doc)]
    assert {doc["kind"] for doc in custom} == {"ScaledObject", "ServiceMonitor"}
    assert [error for doc in custom for error in crd_errors(doc)] == []


CRD_BREAKAGES: list[tuple[str, str, Callable[[Doc], object]]] = [
    ("ScaledObject", "triggers.0.metadata.threshold: 4 is not of type 'string'", lambda d: d["spec"]["triggers"][0]["metadata"].update(threshold=4)),
    ("ScaledObject", "Additional properties are not allowed ('minReplicas' was unexpected)", lambda d: d["spec"].update(minReplicas=1)),
    ("ScaledObject", "scaleTargetRef: 'name' is a required property", lambda d: d["spec"]["scaleTargetRef"].pop("name")),
    ("ScaledObject", "'Average' is not one of", lambda d: d["spec"]["triggers"][0].update(metricType="Average")),
    ("ServiceMonitor", "endpoints.0.interval: '15 s' does not match", lambda d: d["spec"]["endpoints"][0].update(interval="15 s")),
    ("ServiceMonitor", "('intervall' was unexpected)", lambda d: d["spec"]["endpoints"][0].update(intervall="15s")),
    ("ServiceMonitor", "'selector' is a required property", lambda d: d["spec"].pop("selector")),
    ("PodMonitor", "podMetricsEndpoints.0.portNumber: 0 is less than the minimum of 1", lambda d: d["spec"]["podMetricsEndpoints"][0].update(portNumber=0)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "expected", "breakage"), CRD_BREAKAGES, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(CRD_BREAKAGES)]
)
def test_vendored_crd_schemas_refuse_what_the_crds_refuse(
    kind: str, expected: str, breakage: Callable[[Doc], object]
) -> None:
    pytest.importorskip("jsonschema", reason="jsonschema checks the vendored CRD schemas")
    docs = rendered(DEPLOY / "overlays" / "prod")
    doc = next(d for d in docs if d["kind"] == kind) if kind != "PodMonitor" else {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": {"name": "p", "namespace": NS},
        "spec": {"selector": {"matchLabels": {"a": "b"}}, "podMetricsEndpoints": [{"port": "metrics"}]}}  # fmt: skip
    assert crd_errors(doc) == []
    breakage(doc)
    assert any(expected in error for error in crd_errors(doc)), crd_errors(doc)
    assert crd_errors({"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledJob", "metadata": {"name": "j"}})


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_passes_the_semantic_lint(overlay: str) -> None:
    assert lint(rendered(DEPLOY / "overlays" / overlay)) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_serves_every_finetune_behind_one_gateway(overlay: str) -> None:
    docs = rendered(DEPLOY / "overlays" / overlay)
    routing = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("gateway-routing"))
    assert sorted(json.loads(routing["data"]["models.json"])) == list(FINETUNES)
    for name in FINETUNES:
        served = env(containers(_by(docs, "Deployment", f"llm-{name}"), init=False)[0])
        assert served["LLM_MODEL_NAME"]["value"] == name
    gateway_kinds = {d["kind"] for d in docs if d["metadata"]["name"] == "gateway"}
    assert gateway_kinds >= {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_namespaced_object_lands_in_the_namespace_the_targets_name(overlay: str) -> None:
    """`kubectl apply -k` puts an object without metadata.namespace wherever the caller's context
    points (usually `default`), while every target (routes, Redis URLs) names vlm."""
    docs = rendered(DEPLOY / "overlays" / overlay)
    placed = {(d["kind"], d["metadata"]["name"]): d["metadata"].get("namespace") for d in docs}
    assert {key: ns for key, ns in placed.items() if key[0] != "Namespace" and ns != NS} == {}


def test_dev_runs_on_cpus_with_tiny_checkpoints_and_in_cluster_redis() -> None:
    docs = rendered(DEPLOY / "overlays" / "dev")
    limits = [c.get("resources", {}).get("limits", {}) for w in workloads(docs) for c in containers(w)]
    assert not [resource for limit in limits for resource in limit if "gpu" in resource]
    for name in ("encoder", *(f"llm-{f}" for f in FINETUNES)):
        pod = _by(docs, "Deployment", name)["spec"]["template"]["spec"]
        assert pod["initContainers"][0]["command"] == ["python", "-m", "model_builders.tiny", "--out", "/models"]
        assert {"name": "models", "emptyDir": {"sizeLimit": "256Mi"}} in pod["volumes"]
    llm = env(containers(_by(docs, "Deployment", "llm-ft-a"), init=False)[0])
    settings = [llm[f"LLM_{name}"]["value"] for name in ("ENGINE", "DTYPE", "DEVICE")]
    assert settings == ["transformers", "float32", "cpu"]
    assert llm["LLM_REDIS_URL"]["value"] == "redis://:$(REDIS_PASSWORD)@redis.vlm.svc.cluster.local:6379/0"
    redis_container = containers(_by(docs, "Deployment", "redis"))[0]
    assert redis_container["args"][:6] == ["--maxmemory", "384mb", "--maxmemory-policy", "allkeys-lru", "--save", ""]
    assert "--protected-mode" not in redis_container["args"]
    # Dev's one Secret is Redis's password (created out of band); the other references are optional.
    required = [ref for ref in _secret_refs(docs) if not ref.get("optional")]
    assert required and all(ref == {"name": "vlm-redis-password", "key": "password"} for ref in required)
    assert not [d for d in docs if d["kind"] == "Secret"]


def test_prod_runs_on_gpus_with_external_redis_and_referenced_secrets() -> None:
    docs = rendered(DEPLOY / "overlays" / "prod")
    for name in ("encoder", *(f"llm-{f}" for f in FINETUNES)):
        deployment = _by(docs, "Deployment", name)
        container = containers(deployment, init=False)[0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert "replicas" not in deployment["spec"]  # the ScaledObject's
        assert _by(docs, "ScaledObject", name)["spec"]["minReplicaCount"] >= 2
        assert "initContainers" not in deployment["spec"]["template"]["spec"]
        prefix = "ENCODER_" if name == "encoder" else "LLM_"
        assert env(container)[f"{prefix}REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "vlm-redis", "key": "url"}
        assert env(container)[f"{prefix}DTYPE"]["value"] == "bfloat16"
    assert env(containers(_by(docs, "Deployment", "llm-ft-a"))[0])["LLM_ENGINE"]["value"] == "vllm"
    assert not [w for w in workloads(docs) if w["metadata"]["name"] == "redis"]
    assert not [d for d in docs if d["kind"] == "Secret"]
    assert _secret_refs(docs) and not [ref for ref in _secret_refs(docs) if ref.get("optional")]
    assert _by(docs, "HorizontalPodAutoscaler", "gateway")["spec"]["minReplicas"] >= 2


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_pool_scales_on_a_metric_its_service_exports(overlay: str) -> None:
    """The encoder on its batch queue (our gauge), each fine-tune on vLLM's waiting requests."""
    import importlib.util

    from prometheus_client import REGISTRY

    import encoder_service.metrics  # noqa: F401  (registers the encoder's series)

    docs = rendered(DEPLOY / "overlays" / overlay)
    queries = {
        d["metadata"]["name"]: d["spec"]["triggers"][0]["metadata"]["query"]
        for d in docs
        if d["kind"] == "ScaledObject"
    }
    assert queries == {
        "encoder": 'sum(encoder_batch_queue_depth{namespace="vlm",service="encoder"})',
        **{f"llm-{f}": f'sum(vllm:num_requests_waiting{{namespace="vlm",service="llm-{f}"}})' for f in FINETUNES},
    }
    assert "encoder_batch_queue_depth" in {metric.name for metric in REGISTRY.collect()}
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed: cannot check the name of its waiting-requests gauge")
    loggers = Path(spec.origin).parent / "v1" / "metrics" / "loggers.py"
    assert '"vllm:num_requests_waiting"' in loggers.read_text()


def test_adding_a_finetune_is_one_step(tmp_path: Path) -> None:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: cannot render the Kustomize overlays")
    copied = tmp_path / "deploy"
    for part in ("base", "overlays"):
        shutil.copytree(DEPLOY / part, copied / part)
    add_finetune("ft-c", deploy=copied)
    for overlay in OVERLAYS:
        docs = rendered(copied / "overlays" / overlay)
        assert lint(docs) == []
        served = env(containers(_by(docs, "Deployment", "llm-ft-c"), init=False)[0])
        assert served["LLM_CHECKPOINT"]["value"] == "/models/ft-c"
        assert _by(docs, "Service", "llm-ft-c")["spec"]["clusterIP"] == "None"
        query = _by(docs, "ScaledObject", "llm-ft-c")["spec"]["triggers"][0]["metadata"]["query"]
        assert query == 'sum(vllm:num_requests_waiting{namespace="vlm",service="llm-ft-c"})'
    with pytest.raises(SystemExit, match="already exists"):
        add_finetune("ft-c", deploy=copied)
    with pytest.raises(SystemExit, match="lowercase"):
        add_finetune("Bad_Name", deploy=copied)


@pytest.mark.parametrize("name", FINETUNES)
def test_checked_in_finetunes_are_what_the_one_step_writes(name: str) -> None:
    written = (DEPLOY / "base" / "finetunes" / name / "kustomization.yaml").read_text()
    assert written == finetune_kustomization(name, f"/models/{name}")


@pytest.mark.parametrize("service", ["encoder", "llm", "gateway"])
def test_dockerfile_installs_the_project_and_runs_unprivileged(service: str) -> None:
    text = (DEPLOY / "docker" / f"{service}.Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (?!--from)(\S+)", text, re.MULTILINE))
    packages = {"shared", "encoder_service", "llm_service", "gateway", "model_builders"}
    assert copied == packages | {"pyproject.toml"}
    # Each image installs the project with its own extra only (the gateway's brings no torch).
    extras = re.findall(r'pip install "\$\(ls /wheels/\*\.whl\)\[(\w+)\]"', text)
    assert extras and set(extras) == {service}  # the llm file has two targets (cpu, gpu)
    assert service != "gateway" or not re.search(r"torch==|TORCH_", text)
    assert all((ROOT / path).exists() for path in copied)
    users = re.findall(r"^USER (\d+):(\d+)$", text, re.MULTILINE)
    assert users and all(int(uid) > 0 for uid, _ in users)
    module = {"encoder": "encoder_service", "llm": "llm_service", "gateway": "gateway"}[service]
    assert re.search(rf'^CMD \["python3?", "-m", "{module}"\]$', text, re.MULTILINE)
    assert (ROOT / module / "__main__.py").is_file()


# --- each lint rule fails on what it guards against ----------------------------------------


def test_quantities_parse_like_kubernetes() -> None:
    assert parse_quantity("500m") == Decimal("0.5")
    assert parse_quantity("2Gi") == 2 * 2**30
    assert parse_quantity("1e3") == 1000
    assert parse_quantity(4) == 4
    with pytest.raises(ValueError):
        parse_quantity("2 GB")


NS = "vlm"
COMPONENT = "app.kubernetes.io/component"  # what the NetworkPolicies select on
COMPONENTS = {"encoder": "encoder", "llm-ft-a": "llm", "gateway": "gateway", "redis": "cache"}
REDIS_URL = "redis://redis.vlm.svc.cluster.local:6379/0"
# The password comes from a Secret through an env var defined above the URL (dev's form).
REDIS_PASSWORD = {"name": "REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {"name": "redis", "key": "password"}}}
PASSWORD_URL = "redis://:$(REDIS_PASSWORD)@redis.vlm.svc.cluster.local:6379/0"


def _liveness(probe: Doc) -> Doc:
    """A gRPC probe asks the liveness service; others are the same for every kind."""
    return {"grpc": {**probe["grpc"], "service": "liveness"}} if "grpc" in probe else probe


def _server(name: str, port: tuple[str, int], settings: dict[str, str], probe: Doc) -> Doc:
    return {
        "name": name,
        "image": f"example/{name}:1.0",
        "ports": [{"name": port[0], "containerPort": port[1]}],
        "env": [{"name": k, "value": v} for k, v in settings.items()],
        "startupProbe": {**_liveness(probe), "periodSeconds": 10, "failureThreshold": 60},
        "readinessProbe": probe,
        "livenessProbe": _liveness(probe),
        "lifecycle": {"preStop": {"sleep": {"seconds": 5}}},
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"cpu": "1", "memory": "2Gi"}},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }


def _workload(name: str, container: Doc, replicas: int | None = 1) -> list[Doc]:
    """Deployment, Service (headless for gRPC) and PDB around one container."""
    meta = {"name": name, "namespace": NS}
    pod = {
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 30,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
    }
    spec = {
        "selector": {"matchLabels": {"app": name}},
        "template": {"metadata": {"labels": {"app": name, COMPONENT: COMPONENTS[name]}}, "spec": pod},
    }
    if replicas:
        spec["replicas"] = replicas
    ports = [{"name": p["name"], "port": p["containerPort"], "targetPort": p["name"]} for p in container["ports"]]
    service_spec: Doc = {"selector": {"app": name}, "ports": ports}
    if ports[0]["name"] == "grpc":
        service_spec["clusterIP"] = "None"
    service_meta = {**meta, "labels": {COMPONENT: COMPONENTS[name]}}
    return [
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": spec},
        {"apiVersion": "v1", "kind": "Service", "metadata": service_meta, "spec": service_spec},
        {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": dict(meta),
         "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": name}}}},
    ]  # fmt: skip


def _stack() -> list[Doc]:
    """A small lint-clean stack: encoder, one LLM service on a GPU, gateway with HPA, Redis."""
    encoder = _server("encoder", ("grpc", 50051), {
        "ENCODER_CHECKPOINT": "/models/base", "ENCODER_PORT": "50051",
        "ENCODER_REDIS_URL": REDIS_URL, "ENCODER_EMBEDDING_TTL_S": "86400", "ENCODER_GRACE_S": "20"}, {"grpc": {"port": 50051}})  # fmt: skip
    llm = _server("llm", ("grpc", 50061), {
        "LLM_MODEL_NAME": "ft-a", "LLM_CHECKPOINT": "/models/ft-a", "LLM_PORT": "50061", "LLM_DEVICE": "cuda",
        "LLM_REDIS_URL": REDIS_URL, "LLM_EMBEDDING_TTL_S": "86400", "LLM_GRACE_S": "20"}, {"grpc": {"port": 50061}})  # fmt: skip
    encoder["env"] = [REDIS_PASSWORD] + [e for e in encoder["env"] if e["name"] != "ENCODER_REDIS_URL"]
    encoder["env"].append({"name": "ENCODER_REDIS_URL", "value": PASSWORD_URL})
    for torch_server in (encoder, llm):  # threads = limits.cpu ("1")
        torch_server["env"] += [{"name": "OMP_NUM_THREADS", "value": "1"}, {"name": "MKL_NUM_THREADS", "value": "1"}]
    llm["resources"]["limits"]["nvidia.com/gpu"] = 1
    gateway = _server(
        "gateway",
        ("http", 8000),
        {"GATEWAY_PORT": "8000", "GATEWAY_REQUEST_TIMEOUT_S": "20"},
        {"httpGet": {"path": "/livez", "port": "http"}},
    )
    gateway["env"] += [
        {"name": "GATEWAY_MODELS", "valueFrom": {"configMapKeyRef": {"name": "routing", "key": "models.json"}}},
        {"name": "GATEWAY_ENCODER_TARGET", "valueFrom": {"configMapKeyRef": {"name": "routing", "key": "encoder"}}},
        {"name": "GATEWAY_API_KEYS", "valueFrom": {"secretKeyRef": {"name": "keys", "key": "api_keys"}}},
    ]
    redis = _server("redis", ("redis", 6379), {}, {"tcpSocket": {"port": 6379}})
    redis["args"] = ["--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru", "--save", ""]
    routes = {"ft-a": ["dns:///llm-ft-a.vlm.svc.cluster.local:50061"]}
    routing = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "routing", "namespace": NS},
               "data": {"models.json": json.dumps(routes), "encoder": "dns:///encoder.vlm.svc.cluster.local:50051"}}  # fmt: skip
    cpu_target = {"type": "Utilization", "averageUtilization": 70}
    hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "gateway", "namespace": NS},
           "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "gateway"}, "minReplicas": 2,
                    "maxReplicas": 4, "metrics": [{"type": "Resource", "resource": {"name": "cpu", "target": cpu_target}}]}}  # fmt: skip
    # The model servers' counts belong to their ScaledObjects, the gateway's to its HPA.
    workloads_ = [("encoder", encoder, None), ("llm-ft-a", llm, None), ("gateway", gateway, None), ("redis", redis, 1)]
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}
    for server in (encoder, llm):
        server["ports"].append({"name": "metrics", "containerPort": 9090})
    docs = [doc for name, container, replicas in workloads_ for doc in _workload(name, container, replicas)]
    for name in ("encoder", "llm-ft-a"):
        _by(docs, "Deployment", name)["spec"]["template"]["metadata"]["annotations"] = {"prometheus.io/port": "9090"}
    _pod(docs, "llm-ft-a")["topologySpreadConstraints"] = [{
        "maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule",
        "labelSelector": {"matchLabels": {COMPONENT: "llm"}}, "matchLabelKeys": ["app", "pod-template-hash"]}]  # fmt: skip
    docs += _policies() + [
        _scaled("encoder", "encoder_batch_queue_depth"),
        _scaled("llm-ft-a", "vllm:num_requests_waiting"),
    ]
    docs.append({"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": {"name": "models", "namespace": NS},
                 "spec": {"selector": {"matchExpressions": [{"key": COMPONENT, "operator": "In", "values": ["encoder", "llm"]}]},
                          "endpoints": [{"port": "metrics"}]}})  # fmt: skip
    _pod(docs, "gateway")["terminationGracePeriodSeconds"] = 60  # > preStop 5 + 2 phases of 20 s
    return docs + [
        routing,
        hpa,
        namespace,
    ]


def _scaled(name: str, metric: str) -> Doc:
    query = f'sum({metric}{{namespace="{NS}",service="{name}"}})'
    trigger = {"type": "prometheus", "metadata": {"serverAddress": "http://p:9090", "query": query, "threshold": "4"}}
    return {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": {"name": name, "namespace": NS},
            "spec": {"scaleTargetRef": {"name": name}, "minReplicaCount": 1, "maxReplicaCount": 3, "triggers": [trigger]}}  # fmt: skip


def _query(docs: list[Doc], name: str, query: str) -> None:
    _spec(docs, "ScaledObject", name)["triggers"][0]["metadata"]["query"] = query


def _policies() -> list[Doc]:
    """The base's NetworkPolicies and dev's Redis ones, as written, in namespace vlm."""
    yaml = pytest.importorskip("yaml", reason="PyYAML reads the NetworkPolicies")
    files = (DEPLOY / "base" / "network-policies.yaml", DEPLOY / "overlays" / "dev" / "network-policies.yaml")
    docs = [doc for path in files for doc in yaml.safe_load_all(path.read_text()) if doc]
    for doc in docs:
        doc["metadata"]["namespace"] = NS
    return docs


def _policy(docs: list[Doc], name: str) -> Doc:
    return _by(docs, "NetworkPolicy", name)


def _drop(docs: list[Doc], name: str) -> None:
    docs.remove(_policy(docs, name))


def _excepts(docs: list[Doc]) -> list[str]:
    return _policy(docs, "encoder-public-egress")["spec"]["egress"][0]["to"][0]["ipBlock"]["except"]


def _pod(docs: list[Doc], name: str) -> Doc:
    return _by(docs, "Deployment", name)["spec"]["template"]["spec"]


def _ctr(docs: list[Doc], name: str) -> Doc:
    return _pod(docs, name)["containers"][0]


def _res(docs: list[Doc], name: str, section: str) -> Doc:
    return _ctr(docs, name)["resources"][section]


def _sec(docs: list[Doc], name: str) -> Doc:
    return _ctr(docs, name)["securityContext"]


def _redis_args(docs: list[Doc], *args: str) -> None:
    _ctr(docs, "redis")["args"] = list(args)


def _spec(docs: list[Doc], kind: str, name: str) -> Doc:
    return _by(docs, kind, name)["spec"]


def _data(docs: list[Doc]) -> Doc:
    return _by(docs, "ConfigMap", "routing")["data"]


def _set_env(docs: list[Doc], workload: str, name: str, entry: Doc | None) -> None:
    container = _ctr(docs, workload)
    container["env"] = [e for e in container["env"] if e["name"] != name] + ([{"name": name, **entry}] if entry else [])


def _route(target: str) -> Callable[[list[Doc]], None]:
    return lambda docs: _data(docs).update({"models.json": json.dumps({"ft-a": [target]})})


def _one_pdb_for_two(docs: list[Doc]) -> None:
    for name in ("encoder", "llm-ft-a"):
        _by(docs, "Deployment", name)["spec"]["template"]["metadata"]["labels"]["tier"] = "backend"
    _spec(docs, "PodDisruptionBudget", "encoder")["selector"] = {"matchLabels": {"tier": "backend"}}


Breakage = Callable[[list[Doc]], object]
SECRET_DOC = {
    "apiVersion": "v1",
    "kind": "Secret",
    "metadata": {"name": "t", "namespace": NS},
    "stringData": {"token": "x"},
}
CM_TOKEN = {"valueFrom": {"configMapKeyRef": {"name": "routing", "key": "t"}}}

# (rule, text one of its findings must contain, how to break the small stack)
BREAKAGES: list[tuple[str, str, Breakage]] = [
    ("namespaces", "Service/redis: no metadata.namespace", lambda d: _by(d, "Service", "redis")["metadata"].pop("namespace")),
    ("namespaces", "namespace 'default' is not one the overlay renders", lambda d: _by(d, "PodDisruptionBudget", "redis")["metadata"].update(namespace="default")),
    ("store_targets", "no Service redis in namespace default", lambda d: _set_env(d, "encoder", "ENCODER_REDIS_URL", {"value": "redis://redis.default.svc.cluster.local:6379/0"})),
    ("store_targets", "Service/redis has no port 6380", lambda d: _set_env(d, "llm-ft-a", "LLM_REDIS_URL", {"value": "redis://redis.vlm.svc.cluster.local:6380/0"})),
    ("store_targets", "host 'redis' is not <service>.<namespace>", lambda d: _set_env(d, "llm-ft-a", "LLM_REDIS_URL", {"value": "redis://redis:6379/0"})),
    ("names", "not a DNS-1123 label", lambda d: _by(d, "Service", "encoder")["metadata"].update(name="Encoder_svc")),
    ("names", "set more than once", lambda d: _ctr(d, "encoder")["env"].append({"name": "ENCODER_PORT", "value": "1"})),
    ("names", "not an IANA service name", lambda d: _ctr(d, "redis")["ports"][0].update(name="redis-cache-port-x")),
    ("names", "defined 2 times", lambda d: d.append(copy.deepcopy(_by(d, "Service", "encoder")))),
    ("selectors", "does not match its pod template", lambda d: _spec(d, "Deployment", "encoder").update(selector={"matchLabels": {}})),
    ("selectors", "matches 0 workloads", lambda d: _spec(d, "Service", "llm-ft-a").update(selector={"app": "llm"})),
    ("selectors", "matches 2 workloads", _one_pdb_for_two),
    ("selectors", "no PodDisruptionBudget", lambda d: d.remove(_by(d, "PodDisruptionBudget", "llm-ft-a"))),
    ("selectors", "resets the HPA", lambda d: _spec(d, "Deployment", "gateway").update(replicas=3)),
    ("selectors", "does not exist", lambda d: _spec(d, "HorizontalPodAutoscaler", "gateway")["scaleTargetRef"].update(name="gw")),
    ("selectors", "does not request cpu", lambda d: _res(d, "gateway", "requests").pop("cpu")),
    ("service_targets", "'grcp' is not a container port", lambda d: _spec(d, "Service", "encoder")["ports"][0].update(targetPort="grcp")),
    ("service_targets", "6380 is not a container port", lambda d: _spec(d, "Service", "redis")["ports"][0].update(targetPort=6380)),
    ("routing", "is not headless", lambda d: _spec(d, "Service", "llm-ft-a").pop("clusterIP")),
    ("routing", "sets LLM_MODEL_NAME=['ft-b']", lambda d: _set_env(d, "llm-ft-a", "LLM_MODEL_NAME", {"value": "ft-b"})),
    ("routing", "has no port 50062", _route("dns:///llm-ft-a.vlm.svc.cluster.local:50062")),
    ("routing", "no Service llm-ft-a in namespace prod", _route("dns:///llm-ft-a.prod.svc.cluster.local:50061")),
    ("routing", "is not dns:///", _route("llm-ft-a:50061")),
    ("routing", "which the gateway does not route", lambda d: _data(d).update({"models.json": "{}"})),
    ("routing", "sets ENCODER_CHECKPOINT=[]", lambda d: _data(d).update(encoder="dns:///llm-ft-a.vlm.svc.cluster.local:50061")),
    ("routing", "has no key 'encoder'", lambda d: _data(d).pop("encoder")),
    ("probes", "port 50052 is not a declared", lambda d: _ctr(d, "encoder")["readinessProbe"].update(grpc={"port": 50052})),
    ("probes", "no livenessProbe", lambda d: _ctr(d, "gateway").pop("livenessProbe")),
    ("probes", "livenessProbe asks gRPC health service ''", lambda d: _ctr(d, "encoder")["livenessProbe"]["grpc"].pop("service")),
    ("probes", "startupProbe asks gRPC health service ''", lambda d: _ctr(d, "llm-ft-a")["startupProbe"]["grpc"].pop("service")),
    ("probes", "startupProbe allows 30s", lambda d: _ctr(d, "llm-ft-a")["startupProbe"].update(failureThreshold=3)),
    ("probes", "LLM_PORT=50062 but no containerPort", lambda d: _set_env(d, "llm-ft-a", "LLM_PORT", {"value": "50062"})),
    ("quantities", "did you mean Mi/Gi", lambda d: _res(d, "encoder", "limits").update(memory="512m")),
    ("quantities", "'lots' is not a quantity", lambda d: _res(d, "encoder", "requests").update(cpu="lots")),
    ("quantities", "requests.memory 4Gi > limits.memory 2Gi", lambda d: _res(d, "gateway", "requests").update(memory="4Gi")),
    ("quantities", "no limits.cpu", lambda d: _res(d, "redis", "limits").pop("cpu")),
    ("quantities", "sizeLimit: 64 is 64 bytes", lambda d: _pod(d, "redis").update(volumes=[{"name": "v", "emptyDir": {"sizeLimit": 64}}])),
    ("gpus", "in requests; set GPUs in limits only", lambda d: _res(d, "llm-ft-a", "requests").update({"nvidia.com/gpu": 1})),
    ("gpus", "no GPU in limits", lambda d: _res(d, "llm-ft-a", "limits").pop("nvidia.com/gpu")),
    ("gpus", "not a whole number of GPUs", lambda d: _res(d, "llm-ft-a", "limits").update({"nvidia.com/gpu": "500m"})),
    ("gpus", "holds a GPU but device is ['cpu']", lambda d: _set_env(d, "llm-ft-a", "LLM_DEVICE", {"value": "cpu"})),
    ("torch_threads", "llm: runs torch without OMP_NUM_THREADS", lambda d: _set_env(d, "llm-ft-a", "OMP_NUM_THREADS", None)),
    ("torch_threads", "OMP_NUM_THREADS=2 is above the CPU limit 1", lambda d: _set_env(d, "encoder", "OMP_NUM_THREADS", {"value": "2"})),
    ("torch_threads", "OMP_NUM_THREADS='0' is not a positive", lambda d: _set_env(d, "encoder", "OMP_NUM_THREADS", {"value": "0"})),
    ("torch_threads", "MKL_NUM_THREADS=None differs", lambda d: _set_env(d, "llm-ft-a", "MKL_NUM_THREADS", None)),
    ("torch_threads", "gateway: OMP_NUM_THREADS=4 is above", lambda d: _set_env(d, "gateway", "OMP_NUM_THREADS", {"value": "4"})),
    ("no_inline_secrets", "Secret/t: carries data inline", lambda d: d.append(copy.deepcopy(SECRET_DOC))),
    ("no_inline_secrets", "GATEWAY_API_KEYS must come from", lambda d: _set_env(d, "gateway", "GATEWAY_API_KEYS", {"value": "[]"})),
    ("no_inline_secrets", "LLM_GRPC_TOKEN must come from a secretKeyRef", lambda d: _set_env(d, "llm-ft-a", "LLM_GRPC_TOKEN", CM_TOKEN)),
    ("no_inline_secrets", "URL with credentials", lambda d: _set_env(d, "encoder", "ENCODER_REDIS_URL", {"value": "rediss://:pw@r:6380"})),
    ("no_inline_secrets", "ENCODER_REDIS_URL holds a URL with credentials", lambda d: _set_env(d, "encoder", "REDIS_PASSWORD", CM_TOKEN)),
    ("env_references", "ENCODER_REDIS_URL refers to $(REDIS_PASSWORD), not defined above it", lambda d: _ctr(d, "encoder")["env"].reverse()),
    ("env_references", "LLM_REDIS_URL refers to $(REDIS_PASSWORD)", lambda d: _set_env(d, "llm-ft-a", "LLM_REDIS_URL", {"value": PASSWORD_URL})),
    ("env_references", "command refers to $(TOKEN)", lambda d: _ctr(d, "redis")["args"].extend(["--user", "$(TOKEN)"])),
    ("no_inline_secrets", "credentials on the command line", lambda d: _ctr(d, "redis")["args"].extend(["--requirepass", "pw"])),
    ("no_inline_secrets", "key url holds a credential URL", lambda d: _data(d).update(url="redis://u:p@r:6379")),
    ("termination", "12 <= preStop + drain (25s)", lambda d: _pod(d, "encoder").update(terminationGracePeriodSeconds=12)),
    ("termination", "preStop + drain (65s) of llm", lambda d: _set_env(d, "llm-ft-a", "LLM_GRACE_S", {"value": "60"})),
    ("termination", "drain 10s is below the gateway's deadline 20s", lambda d: _set_env(d, "llm-ft-a", "LLM_GRACE_S", {"value": "10"})),
    ("termination", "encoder: drain 20s is below the gateway's deadline 120s", lambda d: _set_env(d, "gateway", "GATEWAY_REQUEST_TIMEOUT_S", {"value": "120"})),
    ("termination", "60 <= preStop + drain (605s) of gateway", lambda d: _set_env(d, "gateway", "GATEWAY_REQUEST_TIMEOUT_S", None)),
    ("termination", "no preStop pause", lambda d: _ctr(d, "gateway").pop("lifecycle")),
    ("security", "runs as uid 0", lambda d: _sec(d, "encoder").update(runAsUser=0)),
    ("security", "runAsNonRoot is not true", lambda d: _pod(d, "gateway")["securityContext"].pop("runAsNonRoot")),
    ("security", "may escalate privileges", lambda d: _sec(d, "llm-ft-a").update(allowPrivilegeEscalation=True)),
    ("security", "capabilities are not drop [ALL]", lambda d: _sec(d, "redis")["capabilities"].update(drop=["NET_RAW"])),
    ("security", "root filesystem is writable", lambda d: _sec(d, "redis").pop("readOnlyRootFilesystem")),
    ("security", "no RuntimeDefault seccomp", lambda d: _pod(d, "redis")["securityContext"].pop("seccompProfile")),
    ("security", "hostPath volume m", lambda d: _pod(d, "encoder").update(volumes=[{"name": "m", "hostPath": {"path": "/m"}}])),
    ("service_links", "inject GATEWAY_PORT", lambda d: _pod(d, "gateway").pop("enableServiceLinks")),
    ("redis", "expected 'allkeys-lru'", lambda d: _redis_args(d, "--maxmemory", "100mb", "--maxmemory-policy", "noeviction")),
    ("redis", "no positive --maxmemory", lambda d: _redis_args(d, "--maxmemory-policy", "allkeys-lru")),
    ("redis", "is not below the memory limit", lambda d: _redis_args(d, "--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru")),
    ("redis", "without a positive ENCODER_EMBEDDING_TTL_S", lambda d: _set_env(d, "encoder", "ENCODER_EMBEDDING_TTL_S", None)),
    ("network_policies", "no default-deny NetworkPolicy", lambda d: _drop(d, "default-deny")),
    ("network_policies", "Deployment/redis -> kube-dns:53/UDP (DNS) is not allowed", lambda d: _drop(d, "dns")),
    ("network_policies", "Deployment/gateway -> Deployment/encoder:50051/TCP (GATEWAY_ENCODER_TARGET) is not allowed", lambda d: _drop(d, "grpc-from-gateway")),
    ("network_policies", "Deployment/gateway -> Deployment/llm-ft-a:50061/TCP (GATEWAY_MODELS)", lambda d: _policy(d, "gateway")["spec"]["egress"].pop()),
    ("network_policies", "Deployment/llm-ft-a -> Deployment/redis:6379/TCP (LLM_REDIS_URL)", lambda d: _drop(d, "redis")),
    ("network_policies", "prometheus -> Deployment/encoder:9090/TCP (metrics)", lambda d: _drop(d, "prometheus")),
    ("network_policies", "does not except 169.254.0.0/16", lambda d: _excepts(d).remove("169.254.0.0/16")),
    ("network_policies", "encoder: can reach the non-public address 169.254.169.254:80", lambda d: _excepts(d).remove("169.254.0.0/16")),
    ("network_policies", "does not except 100.200.0.0/16", lambda d: _policy(d, "encoder-public-egress")["metadata"]["annotations"].update({"vlm-encode-once/cluster-cidrs": "100.200.0.0/16"})),
    ("network_policies", "Deployment/encoder: cannot reach the public address 203.0.113.7:443", lambda d: _drop(d, "encoder-public-egress")),
    ("network_policies", "Deployment/gateway: can reach the public address 203.0.113.7:443", lambda d: _policy(d, "gateway")["spec"]["egress"].append({})),
    ("network_policies", "Deployment/llm-ft-a: a pod of namespace elsewhere can open port grpc", lambda d: _policy(d, "grpc-from-gateway")["spec"]["ingress"][0].pop("from")),
    ("network_policies", "Deployment/redis: a pod of namespace elsewhere can open port redis", lambda d: _policy(d, "redis")["spec"].update(ingress=[{}])),
    ("autoscaling", "Deployment/llm-ft-a sets spec.replicas, which resets the scaler", lambda d: _spec(d, "Deployment", "llm-ft-a").update(replicas=2)),
    ("autoscaling", "scaleTargetRef Deployment/llm does not exist", lambda d: _spec(d, "ScaledObject", "llm-ft-a")["scaleTargetRef"].update(name="llm")),
    ("autoscaling", "replicas 3..2; need 1 <= min <= max", lambda d: _spec(d, "ScaledObject", "encoder").update(minReplicaCount=3, maxReplicaCount=2)),
    ("autoscaling", "replicas 0..3", lambda d: _spec(d, "ScaledObject", "encoder").update(minReplicaCount=0)),
    ("autoscaling", "Deployment/llm-ft-a: a model server with no ScaledObject", lambda d: d.remove(_by(d, "ScaledObject", "llm-ft-a"))),
    ("autoscaling", "Deployment/gateway: 2 autoscalers", lambda d: d.append({**_scaled("gateway", "m"), "metadata": {"name": "gw", "namespace": NS}})),
    ("autoscaling", "Service/encoder does not select Deployment/llm-ft-a", lambda d: _query(d, "llm-ft-a", 'sum(vllm:num_requests_waiting{namespace="vlm",service="encoder"})')),
    ("autoscaling", "selects no Service of the namespace", lambda d: _query(d, "llm-ft-a", 'sum(vllm:num_requests_waiting{namespace="vlm"})')),
    ("autoscaling", 'does not select namespace="vlm"', lambda d: _query(d, "encoder", 'sum(encoder_batch_queue_depth{service="encoder"})')),
    ("autoscaling", "threshold 'many' is not a number", lambda d: _spec(d, "ScaledObject", "encoder")["triggers"][0]["metadata"].update(threshold="many")),
    ("autoscaling", "no ServiceMonitor scrapes Service/llm-ft-a", lambda d: _spec(d, "ServiceMonitor", "models")["selector"]["matchExpressions"][0].update(values=["encoder"])),
    ("monitoring", "Deployment/llm-ft-a: metrics port 9090 is scraped 0 times", lambda d: _spec(d, "ServiceMonitor", "models")["endpoints"][0].update(port="grpc")),
    ("monitoring", "Deployment/encoder: metrics port 9090 is scraped 2 times", lambda d: d.append({"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": {"name": "e", "namespace": NS}, "spec": {"selector": {"matchLabels": {"app": "encoder"}}, "podMetricsEndpoints": [{"port": "metrics"}]}})),
    ("spread", "Deployment/llm-ft-a: holds GPUs but no kubernetes.io/hostname", lambda d: _pod(d, "llm-ft-a").pop("topologySpreadConstraints")),
    ("spread", "selects its pods alone", lambda d: _pod(d, "llm-ft-a")["topologySpreadConstraints"][0].update(matchLabelKeys=[], labelSelector={"matchLabels": {"app.kubernetes.io/part-of": "x"}})),
    ("images", "'example/encoder' has no pinned tag", lambda d: _ctr(d, "encoder").update(image="example/encoder")),
    ("images", "'registry:5000/gw:latest' has no pinned tag", lambda d: _ctr(d, "gateway").update(image="registry:5000/gw:latest")),
]  # fmt: skip


def test_the_small_stack_is_clean() -> None:
    assert lint(_stack()) == []


def test_the_lint_knows_the_services_defaults() -> None:
    """The termination rule reads a missing deadline or grace as the services' own defaults."""
    from deploy.lint import rollout
    from gateway.settings import GatewaySettings
    from shared.settings import GrpcServerSettings

    assert GatewaySettings.model_fields["request_timeout_s"].default == rollout.DEFAULT_DEADLINE_S
    assert GrpcServerSettings.model_fields["grace_s"].default == rollout.DEFAULT_GRACE_S


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_rollout_lets_a_stream_run_to_the_gateway_deadline(overlay: str) -> None:
    """Every LLM pod drains for the whole deadline, and every pod's grace outlasts preStop + drain."""
    docs = rendered(DEPLOY / "overlays" / overlay)
    deadline = float(env(containers(_by(docs, "Deployment", "gateway"))[0])["GATEWAY_REQUEST_TIMEOUT_S"]["value"])
    for name in ("encoder", *(f"llm-{f}" for f in FINETUNES)):
        pod = _by(docs, "Deployment", name)["spec"]["template"]["spec"]
        grace = next(float(e["value"]) for e in pod["containers"][0]["env"] if e["name"].endswith("_GRACE_S"))
        assert grace >= deadline
        assert (
            pod["terminationGracePeriodSeconds"]
            > pod["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"] + grace
        )
    gateway = _by(docs, "Deployment", "gateway")["spec"]["template"]["spec"]
    assert gateway["terminationGracePeriodSeconds"] > 5 + 2 * deadline


def test_every_rule_has_a_breaking_case() -> None:
    assert {rule for rule, _, _ in BREAKAGES} == set(RULES)


@pytest.mark.parametrize(
    ("rule", "expected", "breakage"), BREAKAGES, ids=[f"{r}-{i}" for i, (r, _, _) in enumerate(BREAKAGES)]
)
def test_rule_finds_the_breakage(rule: str, expected: str, breakage: Breakage) -> None:
    docs = _stack()
    assert RULES[rule](docs) == []
    breakage(docs)
    findings = RULES[rule](docs)
    assert any(expected in finding for finding in findings), findings
