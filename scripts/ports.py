"""Free TCP ports for services started later, chosen where no outgoing connection can take them.

A port found by binding port 0 comes from the kernel's ephemeral range, the same range it draws
the local ports of outgoing connections from. Between the pick and the service's bind, a
connection (to Redis, to another service, one of vLLM's own) can take it, and the service dies
with "Failed to bind": a demo in CI lost its `color` service that way. Ports below the ephemeral
range are never handed to outgoing connections, so one free now stays free for us.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 20_000  # above the well-known and most registered service ports
DEFAULT_EPHEMERAL_START = 32_768  # Linux's default, where the file cannot be read
_handed_out: set[int] = set()  # a port given once is not given again by this process


def ephemeral_start() -> int:
    try:
        return int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_START


def free_port() -> int:
    """A port below the ephemeral range that nothing listens on or uses now, on any address."""
    high = ephemeral_start()
    low = LOWEST if high - LOWEST >= 1_000 else 1_024
    for _ in range(200):
        port = random.randrange(low, high)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("", port))  # services bind 0.0.0.0: the port must be free on every address
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free TCP port in {low}-{high - 1}")
