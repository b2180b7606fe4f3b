"""Writes a run's results: <out>/<timestamp>.json, latest.json, latest.md and latest.png.

`python -m bench.report RESULT.json [OUT_DIR]` renders the Markdown and the chart again from a
saved JSON (OUT_DIR defaults to the JSON's folder).
"""

from __future__ import annotations

import json
import math
import sys
import textwrap
from pathlib import Path
from typing import Any

from bench.outcome import MemoryRecord, ScenarioResult, Target
from bench.stats import ratio

GIB = 2**30


def _fmt(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, float) and math.isnan(value):
        return "n/a"
    if isinstance(value, int):
        return f"{value:,}"
    if abs(value) < 10:  # ratios: 1.099 must not print as 1.1 next to a 1.1 limit
        return f"{value:.4g}"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(cell) for cell in row) + " |" for row in rows]
    return lines


def _memory_table(memory: list[MemoryRecord]) -> list[str]:
    rows = [
        [
            m.service,
            m.peak_rss_bytes / GIB,
            m.weight_bytes / GIB,
            ratio(m.peak_rss_bytes, m.weight_bytes),
            m.processes,
            m.weights,
        ]
        for m in memory
    ]
    return _table(["service", "peak RSS GiB", "weights GiB", "RSS / weights", "processes", "weights held"], rows)


def _status(verdict: str) -> str:
    return verdict if verdict == "met" else f"**{verdict}**"


def _scenario_markdown(result: ScenarioResult) -> list[str]:
    lines = [f"## Scenario {result.key}: {result.title}", ""]
    if result.rows:
        rows = [[name, *(row.get(column, "") for column in result.columns)] for name, row in result.rows.items()]
        lines += _table(["system", *result.columns], rows)
        lines.append("")
    if result.ratios:
        lines += [f"- {name}: **{_fmt(value)}**" for name, value in result.ratios.items()] + [""]
    if result.targets:
        rows = [[t.name, f"{_fmt(t.measured)}{t.unit}", f"{t.comparison} {_fmt(t.limit)}{t.unit}",
                 _status(result.verdict(t))] for t in result.targets]  # fmt: skip
        lines += _table(["target", "measured", "limit", "status"], rows) + [""]
    if result.memory:
        lines += ["Memory (peak RSS summed over each service's processes, beside the weights it holds):", ""]
        lines += _memory_table(result.memory) + [""]
    if result.config:
        lines += ["Configuration: " + ", ".join(f"{k}={v}" for k, v in result.config.items()), ""]
    lines += [f"- {note}" for note in result.notes]
    return lines + [""]


def _vector_flags(machine: dict[str, Any]) -> str:
    """The CPU's vector extensions (bench.machine.VECTOR_FLAGS); results before they were recorded say so."""
    flags = machine.get("cpu_vector_flags")
    return ", ".join(flags) if flags else "vector extensions not recorded" if flags is None else "no AVX2"


def markdown(results: list[ScenarioResult], header: dict[str, Any]) -> str:
    machine = header["machine"]
    packages = ", ".join(f"{k} {v}" for k, v in machine["packages"].items())
    lines = [
        "# Benchmark results", "",
        f"- Command: `{header['command']}`",
        f"- Started: {header['started']}, took {header['duration_s']:.0f} s",
        f"- Machine: {machine['nproc']} CPUs ({machine['cpu_model']}; {_vector_flags(machine)}), {machine['ram_gib']} GiB RAM, GPU: {machine['gpu']}; "
        f"load average at start {machine['load_average_at_start']}, at end {header.get('load_average_at_end', 'n/a')}",
        f"- Software: Python {machine['python']}, {packages}",
        f"- Options: {header['options']}", "",
    ]  # fmt: skip
    for result in results:
        lines += _scenario_markdown(result)
    return "\n".join(lines)


def chart(results: list[ScenarioResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    panels = [(r, metric, values) for r in results for metric, values in r.chart.items() if values]
    if not panels:
        return
    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5.2 * columns, 3.8 * rows), squeeze=False)
    for axis, (result, metric, values) in zip(axes.flat, panels, strict=False):
        names, numbers = list(values), [0.0 if math.isnan(v) else v for v in values.values()]
        bars = axis.bar(range(len(names)), numbers, color=[f"C{i % 10}" for i in range(len(names))])
        axis.bar_label(bars, labels=[_fmt(v) for v in values.values()], fontsize=8)
        axis.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
        axis.set_title(f"S{result.key}: {metric}", fontsize=10)
        axis.margins(y=0.15)  # room for the value labels above the bars
    for axis in list(axes.flat)[len(panels) :]:
        axis.set_visible(False)
    figure.suptitle("\n".join(textwrap.wrap(title, 70 * columns)), fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_report(results: list[ScenarioResult], header: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    document = {**header, "scenarios": [r.to_json() for r in results]}
    text = json.dumps(document, indent=2, default=str, allow_nan=True)
    stamped = out_dir / f"{header['started'].replace(':', '').replace('-', '')}.json"
    paths = {
        "json": stamped,
        "latest_json": out_dir / "latest.json",
        "md": out_dir / "latest.md",
        "png": out_dir / "latest.png",
    }
    stamped.write_text(text)
    paths["latest_json"].write_text(text)
    render(results, header, out_dir)
    return paths


def render(results: list[ScenarioResult], header: dict[str, Any], out_dir: Path) -> None:
    """latest.md and latest.png in out_dir."""
    (out_dir / "latest.md").write_text(markdown(results, header))
    machine = header["machine"]
    title = f"{header['command']}  |  {machine['nproc']} CPUs, {machine['cpu_model']}, {header['started']}"
    chart(results, out_dir / "latest.png", title)


def load_results(path: Path) -> tuple[list[ScenarioResult], dict[str, Any]]:
    """A saved run: its scenarios and its header (command, machine, options, ...)."""
    document = json.loads(Path(path).read_text())
    results = []
    for data in document.pop("scenarios"):
        targets = [Target(**{k: v for k, v in t.items() if k not in ("met", "verdict")}) for t in data.pop("targets")]
        memory = [MemoryRecord(**m) for m in data.pop("memory")]
        results.append(ScenarioResult(**data, targets=targets, memory=memory))
    return results, document


def main() -> None:
    source = Path(sys.argv[1])
    out_dir = Path(sys.argv[2]) if len(sys.argv) > 2 else source.parent
    results, header = load_results(source)
    out_dir.mkdir(parents=True, exist_ok=True)
    render(results, header, out_dir)


if __name__ == "__main__":
    main()
