"""What EPD does not do that we do, observed on live EPD instances after the measurement.

Each check returns what it saw, in words, under one of TOPICS; bench/epd_ours_checks.py does the
same things to our stack, and scenario 5 sets the two side by side. Stored items are forged the
way anything with write access to the store could: a file under a uuid the encoder never
produced (our twin: a value under a key the encoder never wrote).

A check may kill a consumer's engine (that is what is observed): each one runs on the first
consumer that still answers /health, the ones expected to be harmless first, and a dead consumer
is left dead (the scenario stops every process afterwards).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file, save

from bench.epd_proxy import content_uuid, encoder_body
from bench.epd_servers import CACHE_FILE, EpdDeployment, consumer_name
from bench.workload import image_url_part

STORE = "where encoder outputs are stored"
ENCODE_API = "an encode API"
FORGED = "a stored item of the right shape, every value NaN"
TRUNCATED = "a stored item cut to half its bytes"
UNKNOWN = "an item that was never stored"
EVICTION = "eviction / TTL"
TOPICS = (STORE, ENCODE_API, FORGED, TRUNCATED, UNKNOWN, EVICTION)
CHECK_FILES = 2  # the forged and the truncated item


def fs_type(path: Path) -> str:
    """The filesystem type /proc/mounts gives for the longest mount point above `path`."""
    best, kind = "", "unknown"
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mount, fstype, *_ = line.split()
        if str(path).startswith(mount) and len(mount) > len(best):
            best, kind = mount, fstype
    return f"{kind} mounted at {best}"


def _base(url: str) -> str:
    return url.split("/v1/", 1)[0]


async def _alive(client: httpx.AsyncClient, chat_url: str) -> bool:
    try:
        return (await client.get(_base(chat_url) + "/health", timeout=10)).status_code == 200
    except httpx.HTTPError:
        return False


def _said(response: httpx.Response) -> str:
    try:
        data = response.json()
    except ValueError:
        return f"HTTP {response.status_code} {response.text[:160]!r}"
    if data.get("choices"):
        return f"HTTP {response.status_code}, answered {data['choices'][0]['message']['content']!r}"
    return f"HTTP {response.status_code} {str(data.get('error', {}).get('message', data))[:160]!r}"


def _root_cause(log_path: Path) -> str:
    """What the dead engine's worker said (vLLM's own wording), from the consumer's log."""
    marker = "Worker failed with error '"
    for line in reversed(log_path.read_text(errors="replace").splitlines()):
        if marker in line:
            return line.split(marker, 1)[1][:160]
    return "(no worker error in its log)"


async def _metadata_only(
    client: httpx.AsyncClient, url: str, model: str, uid: str, grid: list[int]
) -> tuple[str, bool]:
    """A decode request naming `uid` as the proxy would send it; what came back, engine alive after."""
    body = {
        "model": model, "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": [
            {"type": "image_embeds", "image_embeds": {"image_grid_thw": grid}, "uuid": uid},
            {"type": "text", "text": "What is in this image?"}]}],
        "ec_transfer_params": {uid: {"item_indices": [0], "metadata": {"image_grid_thw": grid}}},
    }  # fmt: skip
    try:
        said = _said(await client.post(url, json=body, timeout=120))
    except httpx.HTTPError as error:
        said = f"{type(error).__name__}: {error}"[:200]
    return said, await _alive(client, url)


async def _first_alive(client: httpx.AsyncClient, epd: EpdDeployment) -> tuple[str, str] | None:
    for model, url in epd.routes.decode_urls.items():
        if await _alive(client, url):
            return model, url
    return None


def _fresh_uuid(label: str) -> str:
    return hashlib.sha256(f"{label}-{os.urandom(8).hex()}".encode()).hexdigest()


async def _stored_item(client: httpx.AsyncClient, epd: EpdDeployment, image: bytes) -> tuple[str, list[int]]:
    """The uuid and grid of an image the encoder instance has stored (encodes it if it had not)."""
    part = image_url_part(image)
    model = next(iter(epd.routes.decode_urls))
    reply = await client.post(epd.routes.encoder_url, json=encoder_body(model, [part]), timeout=300)
    reply.raise_for_status()
    uid = content_uuid(part["image_url"]["url"])
    return uid, list(reply.json()["ec_transfer_params"][uid]["metadata"]["image_grid_thw"])


def _forge(storage: Path, uid: str, data: bytes) -> None:
    """Writes `data` where the connector looks for `uid`'s encoder output."""
    (storage / uid).mkdir(exist_ok=True)
    (storage / uid / CACHE_FILE).write_bytes(data)


async def _on_consumer(
    client: httpx.AsyncClient, epd: EpdDeployment, uid: str, grid: list[int], what: str
) -> str:  # fmt: skip
    target = await _first_alive(client, epd)
    if target is None:
        return f"{what}: not run, no consumer left alive"
    model, url = target
    said, alive = await _metadata_only(client, url, model, uid, grid)
    if alive:
        return f"{what}, sent to the {model} consumer: {said}; its engine still answers"
    cause = _root_cause(epd.services[consumer_name(model)][0].log_path)
    return f"{what}, sent to the {model} consumer: {said}; its engine is DEAD (/health fails), its worker said: {cause}"


async def check_epd(epd: EpdDeployment, image: bytes) -> dict[str, str]:
    """Runs every EPD check, the ones that may kill a consumer last; `image` is one of the workload's."""
    seen: dict[str, str] = {}
    async with httpx.AsyncClient(timeout=300) as client:
        seen[STORE] = (f"ECExampleConnector's shared_storage_path {epd.storage} ({fs_type(epd.storage)}): a local "
                       "directory; pods on other nodes see it only through a shared filesystem they all mount")  # fmt: skip
        encode = await client.post(_base(epd.routes.encoder_url) + "/v1/images/encode", json={"image_url": "x"})
        seen[ENCODE_API] = (f"POST /v1/images/encode on the encoder instance: HTTP {encode.status_code}; it encodes "
                            "only inside a chat completion, which answers with ec_transfer_params, not a key to "
                            "keep or share")  # fmt: skip
        uid, grid = await _stored_item(client, epd, image)
        real = load_file(str(epd.storage / uid / CACHE_FILE))["ec_cache"]
        forged = _fresh_uuid("forged")
        _forge(epd.storage, forged, save({"ec_cache": torch.full_like(real, float("nan"))}))
        seen[FORGED] = await _on_consumer(client, epd, forged, grid, f"a forged item {list(real.shape)} of NaN")
        truncated = _fresh_uuid("truncated")
        data = (epd.storage / uid / CACHE_FILE).read_bytes()
        _forge(epd.storage, truncated, data[: len(data) // 2])
        seen[TRUNCATED] = await _on_consumer(client, epd, truncated, grid, "a real item cut to half its bytes")
        folders = sum(1 for p in epd.storage.iterdir() if p.is_dir())
        unknown = _fresh_uuid("unknown")
        seen[UNKNOWN] = await _on_consumer(client, epd, unknown, grid, "a uuid nothing was stored under")
        empty = (epd.storage / unknown).is_dir() and not (epd.storage / unknown / CACHE_FILE).exists()
        seen[UNKNOWN] += f"; the lookup left an empty folder for it: {empty} (folders {folders} -> "
        seen[UNKNOWN] += f"{sum(1 for p in epd.storage.iterdir() if p.is_dir())})"
    return seen


def storage_left(storage: Path) -> str:
    """Called once every EPD process has exited: what the connector leaves behind."""
    files = list(storage.glob(f"*/{CACHE_FILE}"))
    size = sum(path.stat().st_size for path in files)
    return (f"after every EPD process exited, {len(files)} files ({size / 2**20:.1f} MiB: the run's and the "
            f"checks' {CHECK_FILES} forgeries) are still in {storage}: ECExampleConnector has no TTL, "
            "eviction or delete; the benchmark removes the folder")  # fmt: skip


def remove_storage(storage: Path) -> None:
    shutil.rmtree(storage, ignore_errors=True)
