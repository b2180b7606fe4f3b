"""Rules on each workload's own settings: resources, GPUs, torch threads, secrets, security
context, service links, Redis and image tags."""

from __future__ import annotations

import re

from deploy.lint.manifests import (
    Doc,
    containers,
    env,
    env_value,
    ident,
    namespace,
    of_kind,
    parse_quantity,
    pod_spec,
    workloads,
)

GRPC_SERVER_PREFIXES = ("ENCODER_", "LLM_")
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # torch's intra-op pools (OpenMP, MKL)
SECRET_ENV = re.compile(r"TOKEN|PASSWORD|PASSWD|SECRET|API_KEY|CREDENTIAL|PRIVATE_KEY", re.IGNORECASE)
CREDENTIAL_URL = re.compile(r"://[^/\s:@]*:([^/\s@]+)@")
# A password written as $(NAME): the kubelet puts in the value of env NAME, which may be a secretKeyRef.
ENV_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
REDIS_UNITS = {"": 1, "k": 1000, "kb": 1024, "m": 10**6, "mb": 2**20, "g": 10**9, "gb": 2**30}


def quantities(docs: list[Doc]) -> list[str]:
    """Requests and limits for cpu and memory on every container, parseable, requests <= limits,
    memory in bytes that make sense ("512m" is half a byte), emptyDir sizes that parse."""
    found = []
    for w in workloads(docs):
        for c in containers(w):
            found += _resource_findings(f"{ident(w)}/{c['name']}", c.get("resources", {}))
        for vol in pod_spec(w).get("volumes", []):
            size = vol.get("emptyDir", {}).get("sizeLimit") if vol.get("emptyDir") else None
            if size is not None:
                found += _memory_findings(f"{ident(w)}: volume {vol['name']} sizeLimit", size)
    return found


def _resource_findings(where: str, resources: Doc) -> list[str]:
    found, parsed = [], {}
    for section in ("requests", "limits"):
        for resource in ("cpu", "memory"):
            if resource not in resources.get(section, {}):
                found.append(f"{where}: no {section}.{resource}")
        for resource, value in resources.get(section, {}).items():
            try:
                parsed[section, resource] = parse_quantity(value)
            except ValueError as error:
                found.append(f"{where}: {section}.{resource}: {error}")
            if resource == "memory":
                found += _memory_findings(f"{where}: {section}.memory", value)
    for (section, resource), amount in parsed.items():
        limit = parsed.get(("limits", resource))
        if section == "requests" and limit is not None and amount > limit:
            request, limit_text = resources["requests"][resource], resources["limits"][resource]
            found.append(f"{where}: requests.{resource} {request} > limits.{resource} {limit_text}")
    return found


def _memory_findings(where: str, value: object) -> list[str]:
    try:
        amount = parse_quantity(value)
    except ValueError as error:
        return [f"{where}: {error}"]
    return [f"{where}: {value!r} is {amount} bytes; did you mean Mi/Gi?"] if amount < 2**20 else []


def gpus(docs: list[Doc]) -> list[str]:
    """GPUs in limits only, as whole numbers, and on exactly the containers told to use CUDA."""
    found = []
    for w in workloads(docs):
        for c in containers(w):
            where, res = f"{ident(w)}/{c['name']}", c.get("resources", {})
            found += [
                f"{where}: {r} in requests; set GPUs in limits only" for r in res.get("requests", {}) if _is_gpu(r)
            ]
            gpu_limits = {r: v for r, v in res.get("limits", {}).items() if _is_gpu(r)}
            for resource, value in gpu_limits.items():
                if not (str(value).isdigit() and int(value) >= 1):
                    found.append(f"{where}: limits.{resource}={value!r} is not a whole number of GPUs")
            devices = [v for n, e in env(c).items() if n.endswith("_DEVICE") and (v := e.get("value"))]
            wants_gpu = any(d.startswith("cuda") for d in devices)
            if wants_gpu and not gpu_limits:
                found.append(f"{where}: device {devices} but no GPU in limits")
            if gpu_limits and devices and not wants_gpu:
                found.append(f"{where}: holds a GPU but device is {devices}")
    return found


def _is_gpu(resource: str) -> bool:
    return resource.endswith("/gpu")


def torch_threads(docs: list[Doc]) -> list[str]:
    """Containers running torch (ENCODER_*/LLM_* settings, or any that sizes the thread pools) set
    OMP_NUM_THREADS, and MKL_NUM_THREADS alike, to a whole number within their CPU limit: torch
    otherwise starts one thread per CPU of the node, and a pod limited to 2 of 64 is throttled."""
    found = []
    for w in workloads(docs):
        for c in containers(w):
            where, values = f"{ident(w)}/{c['name']}", env(c)
            runs_torch = any(n.startswith(GRPC_SERVER_PREFIXES) for n in values)
            if not runs_torch and not values.keys() & set(THREAD_ENV):
                continue
            if "OMP_NUM_THREADS" not in values:
                found.append(f"{where}: runs torch without OMP_NUM_THREADS; set it to the CPU limit")
                continue
            threads, mkl = env_value(c, "OMP_NUM_THREADS"), env_value(c, "MKL_NUM_THREADS")
            if not (threads and threads.isascii() and threads.isdigit() and int(threads) > 0):
                found.append(f"{where}: OMP_NUM_THREADS={threads!r} is not a positive whole number")
                continue
            if mkl != threads:
                found.append(f"{where}: MKL_NUM_THREADS={mkl!r} differs from OMP_NUM_THREADS={threads!r}")
            limit = c.get("resources", {}).get("limits", {}).get("cpu")
            try:
                if limit is not None and int(threads) > parse_quantity(limit):
                    found.append(f"{where}: OMP_NUM_THREADS={threads} is above the CPU limit {limit}")
            except ValueError:
                pass  # the quantities rule reports it
    return found


def no_inline_secrets(docs: list[Doc]) -> list[str]:
    """No Secret carries data, secret-named env vars come from secretKeyRef, no credentials in
    URLs, arguments or ConfigMaps (a URL's password may be $(NAME) of a secretKeyRef env var)."""
    inline = [s for s in of_kind(docs, "Secret") if s.get("data") or s.get("stringData")]
    found = [f"{ident(s)}: carries data inline; reference a Secret created out of band" for s in inline]
    for cm in of_kind(docs, "ConfigMap"):
        leaks = [key for key, value in cm.get("data", {}).items() if CREDENTIAL_URL.search(str(value))]
        found += [f"{ident(cm)}: key {key} holds a credential URL" for key in leaks]
    for w in workloads(docs):
        for c in containers(w):
            where = f"{ident(w)}/{c['name']}"
            for name, entry in env(c).items():
                if SECRET_ENV.search(name) and "secretKeyRef" not in entry.get("valueFrom", {}):
                    found.append(f"{where}: {name} must come from a secretKeyRef")
                url = CREDENTIAL_URL.search(str(entry.get("value", "")))
                if url and not _from_secret(c, url.group(1)):
                    found.append(f"{where}: {name} holds a URL with credentials")
            words = [str(a) for a in (*c.get("command", []), *c.get("args", []))]
            if any(CREDENTIAL_URL.search(a) or a.lstrip("-").lower() in ("requirepass", "masterauth") for a in words):
                found.append(f"{where}: credentials on the command line")
    return found


def _from_secret(container: Doc, password: str) -> bool:
    reference = ENV_REFERENCE.fullmatch(password)
    entry = env(container).get(reference.group(1), {}) if reference else {}
    return "secretKeyRef" in entry.get("valueFrom", {})


def security(docs: list[Doc]) -> list[str]:
    """Non-root, no privilege escalation, all capabilities dropped, read-only root, seccomp."""
    found = []
    for w in workloads(docs):
        spec = pod_spec(w)
        pod = spec.get("securityContext", {})
        found += [f"{ident(w)}: {key} is set" for key in ("hostNetwork", "hostPID", "hostIPC") if spec.get(key)]
        found += [f"{ident(w)}: hostPath volume {v['name']}" for v in spec.get("volumes", []) if "hostPath" in v]
        for c in containers(w):
            ctx = c.get("securityContext", {})
            where = f"{ident(w)}/{c['name']}"
            if ctx.get("runAsNonRoot", pod.get("runAsNonRoot")) is not True:
                found.append(f"{where}: runAsNonRoot is not true")
            if ctx.get("runAsUser", pod.get("runAsUser")) == 0:
                found.append(f"{where}: runs as uid 0")
            if ctx.get("allowPrivilegeEscalation") is not False or ctx.get("privileged"):
                found.append(f"{where}: may escalate privileges (set allowPrivilegeEscalation: false)")
            if "ALL" not in ctx.get("capabilities", {}).get("drop", []) or ctx.get("capabilities", {}).get("add"):
                found.append(f"{where}: capabilities are not drop [ALL]")
            if ctx.get("readOnlyRootFilesystem") is not True:
                found.append(f"{where}: root filesystem is writable")
            seccomp = ctx.get("seccompProfile", pod.get("seccompProfile", {})).get("type")
            if seccomp not in ("RuntimeDefault", "Localhost"):
                found.append(f"{where}: no RuntimeDefault seccomp profile")
    return found


def service_links(docs: list[Doc]) -> list[str]:
    """A ClusterIP Service named like a settings prefix injects <NAME>_PORT=tcp://... into pods
    that keep service links on (Service `gateway` -> GATEWAY_PORT), breaking that setting."""
    found = []
    for w in workloads(docs):
        if pod_spec(w).get("enableServiceLinks") is False:
            continue
        injected = {
            s["metadata"]["name"].upper().replace("-", "_") + "_"
            for s in of_kind(docs, "Service")
            if namespace(s) == namespace(w) and s["spec"].get("clusterIP") != "None"
        }
        for c in containers(w):
            prefixes = {n.split("_", 1)[0] + "_" for n in env(c) if "_" in n}
            clashes = sorted(i for i in injected for p in prefixes if i.startswith(p))
            if clashes:
                where = f"{ident(w)}/{c['name']}"
                found.append(
                    f"{where}: service links inject {clashes[0]}PORT into its settings; set enableServiceLinks: false"
                )
    return found


def redis(docs: list[Doc]) -> list[str]:
    """Redis is a bounded LRU cache (maxmemory under the memory limit, allkeys-lru) and every
    client writes keys with an explicit positive TTL."""
    found = []
    for w in workloads(docs):
        for c in containers(w):
            where = f"{ident(w)}/{c['name']}"
            if c.get("image", "").rsplit("/", 1)[-1].startswith(("redis", "valkey")):
                found += _redis_server_findings(where, c)
            for name in (n for n in env(c) if n.endswith("_REDIS_URL")):
                ttl_name = name.removesuffix("REDIS_URL") + "EMBEDDING_TTL_S"
                ttl = env_value(c, ttl_name)
                if ttl is None or not ttl.isdigit() or int(ttl) <= 0:
                    found.append(f"{where}: uses Redis ({name}) without a positive {ttl_name}")
    return found


def _redis_server_findings(where: str, container: Doc) -> list[str]:
    args = [str(a) for a in (*container.get("command", []), *container.get("args", []))]
    option = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--")}
    found = []
    if option.get("--maxmemory-policy") != "allkeys-lru":
        found.append(f"{where}: --maxmemory-policy is {option.get('--maxmemory-policy')!r}, expected 'allkeys-lru'")
    match = re.fullmatch(r"(\d+)([kmg]b?)?", option.get("--maxmemory", "").lower())
    if not match or int(match.group(1)) == 0:
        return [*found, f"{where}: no positive --maxmemory"]
    limit = container.get("resources", {}).get("limits", {}).get("memory")
    maxmemory = int(match.group(1)) * REDIS_UNITS[match.group(2) or ""]
    try:
        if limit is None or maxmemory >= parse_quantity(limit):
            found.append(f"{where}: --maxmemory {option['--maxmemory']} is not below the memory limit {limit}")
    except ValueError:
        pass  # the quantities rule reports it
    return found


def images(docs: list[Doc]) -> list[str]:
    """Every image is pinned by a tag or digest, never `latest`."""
    found = []
    for w in workloads(docs):
        for c in containers(w):
            image = c.get("image", "")
            last = image.rsplit("/", 1)[-1]
            if "@sha256:" not in image and (":" not in last or last.endswith(":latest")):
                found.append(f"{ident(w)}/{c['name']}: image {image!r} has no pinned tag")
    return found
