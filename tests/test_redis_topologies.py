"""The store against Redis Cluster and Sentinel, chosen by the URL; the end-to-end
path (encode -> store -> generate) against a real 3-primary cluster on loopback."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from encoder_service.batcher import MicroBatcher
from encoder_service.core import EncoderCounters
from encoder_service.server import start_encoder_server
from encoder_service.settings import EncoderSettings
from encoder_service.single_flight import SingleFlight
from llm_service.blob_cache import BlobCache
from llm_service.server import start_llm_server
from llm_service.settings import LLMSettings
from shared.redis_urls import parse_redis_url
from shared.sdk import EncoderClient, ImageKey, LLMClient, Message, Sampling
from shared.store import EmbeddingStore, StoreConfig
from tests.harness import BackgroundLoop, RedisServer, Stack, free_port
from tests.images import png_bytes


def test_urls_choose_the_topology() -> None:
    cluster = parse_redis_url("rediss-cluster://app:pw@10.0.0.1:7000,10.0.0.2:7001")
    assert (cluster.topology, cluster.nodes, cluster.username, cluster.password, cluster.tls) == (
        "cluster", (("10.0.0.1", 7000), ("10.0.0.2", 7001)), "app", "pw", True)  # fmt: skip
    sentinel = parse_redis_url("redis-sentinel://:pw@s1:26379,s2:26379/mymaster/2")
    assert (sentinel.topology, sentinel.service_name, sentinel.db, sentinel.password) == (
        "sentinel",
        "mymaster",
        2,
        "pw",
    )
    assert parse_redis_url("redis://localhost:6379/0").topology == "single"
    for bad in ("localhost:6379", "redis-cluster://nohostport", "redis-sentinel://s1:26379", "memcached://x:1"):
        with pytest.raises(ValueError):
            parse_redis_url(bad)


def _wait(check: Callable[[], bool], what: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except redis.RedisError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not come up")


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Three primaries on loopback, slots spread by redis-cli --cluster create."""
    ports, processes = [free_port() for _ in range(3)], []
    for port in ports:
        workdir = tmp_path_factory.mktemp(f"cluster-{port}")
        processes.append(subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
             # An explicit bus port: the default (port + 10000) may be taken or past 65535.
             "--cluster-port", str(free_port()), "--cluster-config-file",
             str(workdir / "nodes.conf"), "--save", "", "--appendonly", "no", "--dir", str(workdir)],
            stdout=subprocess.DEVNULL,
        ))  # fmt: skip
    try:
        for port in ports:
            _wait(lambda port=port: redis.Redis(port=port).ping(), f"cluster node {port}")
        nodes = [f"127.0.0.1:{port}" for port in ports]
        subprocess.run(["redis-cli", "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True)  # fmt: skip
        _wait(
            lambda: all(
                redis.Redis(port=p, decode_responses=True).cluster("info")["cluster_state"] == "ok" for p in ports
            ),
            "cluster",
            timeout_s=60,
        )
        yield "redis-cluster://" + ",".join(nodes)
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=10)


def test_store_spreads_keys_over_slots_and_reads_them_back(redis_cluster: str) -> None:
    async def run() -> list[bytes | None]:
        store = EmbeddingStore(StoreConfig(url=redis_cluster, ttl_s=60))
        for index in range(20):
            await store.put(f"emb:v1:test:{index}", f"blob-{index}".encode())
        found = await store.get_many([f"emb:v1:test:{i}" for i in range(20)] + ["emb:v1:test:missing"])
        await store.aclose()
        return found

    assert asyncio.run(run()) == [f"blob-{i}".encode() for i in range(20)] + [None]


def test_end_to_end_against_the_cluster_matches_single_redis(
    redis_cluster: str, stack: Stack, background_loop: BackgroundLoop
) -> None:
    """A second encoder and LLM service (sharing the loaded models) whose store is the cluster."""
    cluster_store = StoreConfig(url=redis_cluster, ttl_s=300)
    encoder_core = dataclasses.replace(
        stack.encoder.core, store=EmbeddingStore(cluster_store), counters=EncoderCounters(), _in_flight=SingleFlight(),
        batcher=MicroBatcher(stack.encoder.core.vision.encode_batch, 8, 0.005),
    )  # fmt: skip
    llm_core = dataclasses.replace(stack.llms["ft-b"].core, store=EmbeddingStore(cluster_store), cache=BlobCache(0))
    common = {"host": "127.0.0.1", "port": 0, "redis_url": redis_cluster}
    encoder = background_loop.run(
        start_encoder_server(EncoderSettings(checkpoint="unused", **common), core=encoder_core)
    )
    llm = background_loop.run(
        start_llm_server(LLMSettings(checkpoint="unused", model_name="ft-b", **common), core=llm_core)
    )
    try:
        images = [png_bytes(500 + i) for i in range(3)]
        with EncoderClient(f"127.0.0.1:{encoder.port}") as cluster_encoder:
            keys = [cluster_encoder.encode(image_bytes=image).key for image in images]
        with EncoderClient(stack.encoder_target) as single_encoder:
            assert keys == [single_encoder.encode(image_bytes=image).key for image in images]
        message = [Message("user", [*(ImageKey(k) for k in keys), "Which one?"])]
        with LLMClient(f"127.0.0.1:{llm.port}") as on_cluster, LLMClient(stack.llm_target("ft-b")) as on_single:
            tokens = [[t for c in client.generate("ft-b", message, Sampling(max_tokens=6)) for t in c.token_ids]
                      for client in (on_cluster, on_single)]  # fmt: skip
        assert tokens[0] == tokens[1] and tokens[0]
    finally:
        background_loop.run(encoder.stop())
        # Not llm.stop(): that would also close ft-b's engine, which this server only borrows.
        background_loop.run(llm.running.stop(0))
        background_loop.run(llm_core.store.aclose())


def test_sentinel_url_reaches_the_monitored_primary(redis_server: RedisServer, tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "sentinel.conf"
    config.write_text(f"port {port}\nbind 127.0.0.1\nsentinel monitor mymaster 127.0.0.1 {redis_server.port} 1\n")
    process = subprocess.Popen(["redis-server", str(config), "--sentinel"], stdout=subprocess.DEVNULL)
    try:
        _wait(lambda: redis.Redis(port=port).ping(), "sentinel")

        async def run() -> bytes | None:
            store = EmbeddingStore(StoreConfig(url=f"redis-sentinel://127.0.0.1:{port}/mymaster", ttl_s=60))
            await store.put("emb:v1:test:sentinel", b"via sentinel")
            found = await store.get_many(["emb:v1:test:sentinel"])
            await store.aclose()
            return found[0]

        watcher = redis.Redis(port=port)  # one connection: its own first refusals come before the count
        refused_before = watcher.info("stats")["total_error_replies"]
        assert asyncio.run(run()) == b"via sentinel"
        assert redis_server.client().get("emb:v1:test:sentinel") == b"via sentinel"
        # Nothing the sentinel refuses: redis-py 8 sent its connections CLIENT SETINFO and a
        # maintenance-notifications request (refused before Redis 7.2), as _QUIET_CONNECT says.
        assert watcher.info("stats")["total_error_replies"] == refused_before
        watcher.close()
    finally:
        process.terminate()
        process.wait(timeout=10)
