"""Each rule of the semantic lint (deploy/lint) on a small lint-clean stack: the stack passes
every rule, and each rule finds the breakage it guards against."""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import pytest

from deploy.lint import RULES, lint
from deploy.lint.manifests import parse_quantity
from tests.test_deploy import DEPLOY, NS, _by

Doc = dict[str, Any]


def test_quantities_parse_like_kubernetes() -> None:
    assert parse_quantity("500m") == Decimal("0.5")
    assert parse_quantity("2Gi") == 2 * 2**30
    assert parse_quantity("1e3") == 1000
    assert parse_quantity(4) == 4
    with pytest.raises(ValueError):
        parse_quantity("2 GB")


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
        _scaled("llm-ft-a", "llm_requests_waiting"),
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
    return copy.deepcopy(_policy_files())


@functools.cache
def _policy_files() -> list[Doc]:
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
    ("autoscaling", "Service/encoder does not select Deployment/llm-ft-a", lambda d: _query(d, "llm-ft-a", 'sum(llm_requests_waiting{namespace="vlm",service="encoder"})')),
    ("autoscaling", "selects no Service of the namespace", lambda d: _query(d, "llm-ft-a", 'sum(llm_requests_waiting{namespace="vlm"})')),
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
