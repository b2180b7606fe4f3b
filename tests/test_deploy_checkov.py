"""checkov over every rendered overlay: each check it fails is in deploy/lint/checkov-skips.yaml
with its reason, and each skip listed there still fails (no stale skip). checkov lives in its
own virtual environment, .venv-tools (`make tools`, from deploy/lint/checkov-requirements.txt),
because its pins conflict with the project's."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.test_deploy import DEPLOY, OVERLAYS, ROOT, rendered

# Runs checkov in a subprocess (see the tiers in tests/conftest.py).
pytestmark = pytest.mark.integration

CHECKOV = ROOT / ".venv-tools" / "bin" / "checkov"
SKIPS = DEPLOY / "lint" / "checkov-skips.yaml"


def _skips() -> dict[str, Any]:
    yaml = pytest.importorskip("yaml", reason="PyYAML reads the skip list")
    return dict(yaml.safe_load(SKIPS.read_text()))


def test_every_skip_says_why_and_where() -> None:
    for check, entry in _skips().items():
        assert check.startswith("CKV_K8S_") and set(entry) == {"title", "overlays", "reason"}, check
        assert entry["overlays"] and set(entry["overlays"]) <= set(OVERLAYS), check
        assert len(entry["reason"].split()) >= 15, f"{check}: say why it is skipped"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_checkov_fails_each_overlay_only_on_the_documented_skips(overlay: str, tmp_path: Path) -> None:
    if not CHECKOV.is_file():
        pytest.skip(
            f"{CHECKOV.relative_to(ROOT)} is absent: `make tools` builds it from deploy/lint/checkov-requirements.txt"
        )
    yaml = pytest.importorskip("yaml", reason="PyYAML writes the rendered overlay")
    docs = rendered(DEPLOY / "overlays" / overlay)
    manifest = tmp_path / f"{overlay}.yaml"
    manifest.write_text(yaml.safe_dump_all(docs))
    # --skip-download: no call to Prisma Cloud for guidelines (none is reachable in CI either).
    argv = [str(CHECKOV), "-f", str(manifest), "--framework", "kubernetes", "--skip-download", "--quiet", "--compact",
            "-o", "json"]  # fmt: skip
    run = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert run.returncode in (0, 1), run.stderr[-3000:]  # 1: some check failed
    report = json.loads(run.stdout)
    summary = report["summary"]
    assert summary["parsing_errors"] == 0 and summary["resource_count"] > 0, summary
    failed: dict[str, list[str]] = {}
    for result in report["results"]["failed_checks"]:
        failed.setdefault(result["check_id"], []).append(result["resource"])
    documented = {check for check, entry in _skips().items() if overlay in entry["overlays"]}
    undocumented = {check: resources for check, resources in failed.items() if check not in documented}
    assert undocumented == {}, "fix these or add them, with a reason, to deploy/lint/checkov-skips.yaml"
    assert documented - failed.keys() == set(), "these skips no longer fail: remove them from the skip list"
