"""Dev Redis requires a password: the rendered dev overlay's Redis container, run here as the
kubelet would run it (its command, args and Secret-backed env), refuses a client without the
password and serves the URL the encoder and LLM pods build from the same Secret; its readiness
probe passes only with the password."""

from __future__ import annotations

import re
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deploy.lint.manifests import containers
from scripts.ports import free_port
from tests.test_deploy import DEPLOY, rendered

# Runs redis-server (see the tiers in tests/conftest.py).
pytestmark = pytest.mark.integration

Doc = dict[str, Any]
ENV_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _container(docs: list[Doc], name: str) -> Doc:
    deployment = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == name)
    return containers(deployment, init=False)[0]


def _kubelet_env(container: Doc, secret_values: dict[tuple[str, str], str]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: Secret values, then $(NAME) of an
    entry above replaced by its value (an unknown name stays as written)."""
    values: dict[str, str] = {}
    for entry in container.get("env", []):
        ref = entry.get("valueFrom", {}).get("secretKeyRef")
        if ref is not None:
            if (ref["name"], ref["key"]) in secret_values:
                values[entry["name"]] = secret_values[ref["name"], ref["key"]]
            continue
        if "value" in entry:
            values[entry["name"]] = ENV_REFERENCE.sub(lambda m: values.get(m.group(1), m.group(0)), entry["value"])
    return values


@pytest.fixture
def dev_redis(tmp_path: Path) -> Iterator[tuple[list[Doc], int, str]]:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server and redis-cli are needed to run the dev Redis container's command")
    docs = rendered(DEPLOY / "overlays" / "dev")
    redis = _container(docs, "redis")
    password = secrets.token_hex(16)
    env = _kubelet_env(redis, {("vlm-redis-password", "password"): password})
    port = free_port()
    # The container's own command and args; only the port and address are this machine's.
    argv = [*redis["command"], *redis["args"], "--port", str(port), "--bind", "127.0.0.1"]
    process = subprocess.Popen(argv, cwd=tmp_path, env={"PATH": "/usr/bin:/bin", **env})
    try:
        deadline = time.monotonic() + 10
        while subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True).returncode != 0:
            assert process.poll() is None and time.monotonic() < deadline, "dev Redis did not start"
            time.sleep(0.05)
        yield docs, port, password
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_dev_redis_refuses_clients_without_the_password(dev_redis: tuple[list[Doc], int, str]) -> None:
    import redis

    docs, port, password = dev_redis
    for name, prefix in (("encoder", "ENCODER"), ("llm-ft-a", "LLM")):
        env = _kubelet_env(_container(docs, name), {("vlm-redis-password", "password"): password})
        url = env[f"{prefix}_REDIS_URL"].replace("redis.vlm.svc.cluster.local:6379", f"127.0.0.1:{port}")
        assert password in url
        client = redis.Redis.from_url(url)
        assert client.set(f"k-{name}", b"v") and client.get(f"k-{name}") == b"v"
        # The args reached the server: a bounded LRU cache.
        assert client.config_get("maxmemory") == {"maxmemory": str(384 * 2**20)}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
        client.close()
    anonymous = redis.Redis(host="127.0.0.1", port=port)
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    anonymous.close()
    # The password is not on the server's command line.
    listing = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert password not in listing


def test_dev_redis_readiness_probe_needs_the_password(dev_redis: tuple[list[Doc], int, str]) -> None:
    docs, port, password = dev_redis
    redis = _container(docs, "redis")
    probe = [*redis["readinessProbe"]["exec"]["command"]]
    probe[-1] = probe[-1].replace("redis-cli", f"redis-cli -p {port}")
    env = _kubelet_env(redis, {("vlm-redis-password", "password"): password})
    assert subprocess.run(probe, env={"PATH": "/usr/bin:/bin", **env}).returncode == 0
    env["REDISCLI_AUTH"] = "wrong"
    assert subprocess.run(probe, env={"PATH": "/usr/bin:/bin", **env}, capture_output=True).returncode != 0
