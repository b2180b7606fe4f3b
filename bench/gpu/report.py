"""The run's JSON and its Markdown rendering, written again after every part so that a run cut
short still leaves what it measured. `python -m bench.gpu.report RESULT.json` renders the
Markdown again from a saved JSON, beside it."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any


def _fmt(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, float) and math.isnan(value):
        return "n/a"
    if isinstance(value, int):
        return f"{value:,}"
    if abs(value) < 1:  # utilisations and small ratios keep their digits
        return f"{value:.3f}"
    return f"{value:.4g}" if abs(value) < 1000 else f"{value:,.0f}"


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(_fmt(cell) for cell in row) + " |" for row in rows]


def _part(part: dict[str, Any]) -> list[str]:
    lines = [f"## {part['title']}", ""]
    if part["rows"]:
        columns = [c for c in part["columns"] if any(c in row for row in part["rows"].values())]
        rows = [[name, *(row.get(c, "") for c in columns)] for name, row in part["rows"].items()]
        lines += _table(["", *columns], rows) + [""]
    lines += [f"- {name}: **{_fmt(value)}**" for name, value in part["ratios"].items()]
    if part["targets"]:
        rows = [[t["name"], f"{_fmt(t['measured'])}{t['unit']}", f"{t['comparison']} {_fmt(t['limit'])}{t['unit']}",
                 "met" if t["met"] else "**not met**"] for t in part["targets"]]  # fmt: skip
        lines += [""] + _table(["check", "measured", "expected", "status"], rows)
    if part["memory"]:
        rows = [[m["service"], m["peak_rss_bytes"] / 2**30, m["processes"]] for m in part["memory"]]
        lines += ["", "Host memory of the service:", ""] + _table(["service", "peak RSS GiB", "processes"], rows)
    if part["config"]:
        lines += ["", "Configuration: " + ", ".join(f"{k}={_fmt(v)}" for k, v in part["config"].items())]
    return lines + [f"- {note}" for note in part["notes"]] + [""]


def markdown(run: dict[str, Any]) -> str:
    machine, device = run["machine"], run["device"]
    versions = machine["packages"] | machine.get("more_packages", {})
    packages = ", ".join(f"{k} {v}" for k, v in versions.items())
    device_line = ", ".join(f"{k} {v}" for k, v in device.items())
    lines = [
        f"# GPU measurements ({device.get('name', device['device'])})",
        "",
        f"Command: `{run['command']}`",
        "",
        f"Started {run['started']}, {_fmt(run.get('elapsed_s', float('nan')))} s in all. Device: {device_line}. "
        f"Host: {machine['nproc']} CPUs ({machine['cpu_model']}), {machine['ram_gib']} GiB RAM, Python "
        f"{machine['python']}; {packages}.",
        "",
    ]
    times = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in run["part_seconds"].items())
    lines += [f"Seconds per part: {times}.", ""]
    for part in run["parts"]:
        lines += _part(part)
    for name, reason in run["skipped"].items():
        lines += [f"## {name}: skipped", "", reason, ""]
    for name, error in run["errors"].items():
        lines += [f"## {name}: failed", "", "```", error, "```", ""]
    return "\n".join(lines)


def write(run: dict[str, Any], out: Path, stem: str) -> Path:
    """<out>/<stem>.json and <stem>.md; returns the JSON's path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}.json"
    path.write_text(json.dumps(run, indent=2, default=str) + "\n")
    (out / f"{stem}.md").write_text(markdown(run))
    return path


if __name__ == "__main__":
    saved = Path(sys.argv[1])
    saved.with_suffix(".md").write_text(markdown(json.loads(saved.read_text())))
