"""What a scenario hands to the report: rows per compared system, ratios, targets, memory, notes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class Target:
    """One of the issue's targets, checked against a measured value."""

    name: str  # e.g. "throughput ours / direct"
    measured: float
    comparison: Literal[">=", "<=", "=="]  # met when `measured <comparison> limit`
    limit: float
    unit: str = ""

    @property
    def met(self) -> bool:
        if self.comparison == ">=":
            return self.measured >= self.limit
        if self.comparison == "<=":
            return self.measured <= self.limit
        return self.measured == self.limit


@dataclass(frozen=True)
class MemoryRecord:
    """Peak resident memory of one service (its process tree) beside the weights it holds.

    peak_rss_bytes sums VmHWM over the process and its children: pages they share are counted
    once per process, so it is an upper bound for a multi-process server such as vLLM.
    """

    service: str
    peak_rss_bytes: int
    weight_bytes: int
    weights: str  # which tensors, at which dtype
    processes: int


@dataclass
class ScenarioResult:
    key: str  # "1".."4"
    title: str
    columns: list[str]  # table columns after "system"
    rows: dict[str, dict[str, Any]]  # system -> column -> value
    ratios: dict[str, float] = field(default_factory=dict)
    targets: list[Target] = field(default_factory=list)
    memory: list[MemoryRecord] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    chart: dict[str, dict[str, float]] = field(default_factory=dict)  # metric -> system -> value

    def failed_requests(self) -> dict[str, int]:
        """system -> its failed requests, for each system that had any."""
        return {name: int(row["errors"]) for name, row in self.rows.items() if row.get("errors")}

    def verdict(self, target: Target) -> str:
        """ "met", "not met", or "not judged" when a compared system failed requests: its wall and
        TTFT then time a run that did not do the work (a peer whose requests fail early looks fast,
        one whose requests time out looks slow), so neither side's ratio means anything."""
        failed = self.failed_requests()
        if failed:
            return "not judged: " + ", ".join(f"{name} failed {count} requests" for name, count in failed.items())
        return "met" if target.met else "not met"

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        verdicts = [self.verdict(t) for t in self.targets]
        data["targets"] = [
            {**asdict(t), "met": v == "met", "verdict": v} for t, v in zip(self.targets, verdicts, strict=True)
        ]
        return data
