"""`python -m deploy.lint [KUSTOMIZATION_DIR ...]`: render each and print the findings."""

from __future__ import annotations

import sys
from pathlib import Path

from deploy.lint import lint, render

DEFAULT_OVERLAYS = ("deploy/overlays/dev", "deploy/overlays/prod")


def main(argv: list[str]) -> int:
    findings = [f"{path}: {finding}" for path in argv or DEFAULT_OVERLAYS for finding in lint(render(Path(path)))]
    print("\n".join(findings) or "clean")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
