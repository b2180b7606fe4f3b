"""CPU seconds used by services' process trees, from /proc: what a system under test costs the
machine per request, whatever else runs beside it (wall-clock ratios move with the machine's
other load; CPU time much less)."""

from __future__ import annotations

import os
from pathlib import Path

from bench.procs import Service, process_tree

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _cpu_ticks(pid: int) -> int:
    """utime + stime of one process, 0 if it is gone. The command name (field 2) may hold spaces,
    so fields are counted from its closing parenthesis."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5), from field 3


def process_cpu_seconds(pid: int) -> float:
    """CPU time so far of one process (0 if it is gone)."""
    return _cpu_ticks(pid) / _TICKS_PER_S


def _command_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def cpu_seconds_by_process(services: list[Service]) -> dict[str, float]:
    """CPU time so far of every process of these services (children included: vLLM's EngineCore and
    Worker), as {"<service> <command name>": seconds}; processes of one name in a service add up."""
    seconds: dict[str, float] = {}
    for service in services:
        for pid in process_tree(service.process.pid):
            label = f"{service.name} {_command_name(pid)}"
            seconds[label] = seconds.get(label, 0.0) + process_cpu_seconds(pid)
    return seconds
