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
from pathlib import Path
from typing import Any

import pytest

from deploy.add_finetune import add_finetune, finetune_kustomization
from deploy.lint import lint, render
from deploy.lint.crds import crd_errors, is_custom
from deploy.lint.manifests import containers, env, workloads

# Starts processes of its own (see the tiers in tests/conftest.py).
pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
OVERLAYS = ("dev", "prod")
OLDEST_KUBERNETES = "1.30"  # native gRPC probes and the preStop sleep action
FINETUNES = ("ft-a", "ft-b")
NS = "vlm"  # base/kustomization.yaml
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
    """The encoder on its batch queue, each fine-tune on its requests waiting for a first token
    (our gauges, the same whatever the engine)."""
    from prometheus_client import REGISTRY

    import encoder_service.metrics  # noqa: F401  (registers the encoder's series)
    import llm_service.metrics  # noqa: F401  (and the LLM service's)

    docs = rendered(DEPLOY / "overlays" / overlay)
    queries = {
        d["metadata"]["name"]: d["spec"]["triggers"][0]["metadata"]["query"]
        for d in docs
        if d["kind"] == "ScaledObject"
    }
    assert queries == {
        "encoder": 'sum(encoder_batch_queue_depth{namespace="vlm",service="encoder"})',
        **{f"llm-{f}": f'sum(llm_requests_waiting{{namespace="vlm",service="llm-{f}"}})' for f in FINETUNES},
    }
    assert {"encoder_batch_queue_depth", "llm_requests_waiting"} <= {metric.name for metric in REGISTRY.collect()}


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
        assert query == 'sum(llm_requests_waiting{namespace="vlm",service="llm-ft-c"})'
    with pytest.raises(SystemExit, match="already exists"):
        add_finetune("ft-c", deploy=copied)
    with pytest.raises(SystemExit, match="lowercase"):
        add_finetune("Bad_Name", deploy=copied)


@pytest.mark.parametrize("name", FINETUNES)
def test_checked_in_finetunes_are_what_the_one_step_writes(name: str) -> None:
    written = (DEPLOY / "base" / "finetunes" / name / "kustomization.yaml").read_text()
    assert written == finetune_kustomization(name, f"/models/{name}")


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
