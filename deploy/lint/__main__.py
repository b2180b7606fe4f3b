"""`python -m deploy.lint [KUSTOMIZATION_DIR ...]`: render each and print the findings, with the
custom resources checked against their vendored schemas (deploy/lint/crds.py)."""

from __future__ import annotations

import sys
from pathlib import Path

from deploy.lint import lint, render
from deploy.lint.crds import crd_errors, is_custom

DEFAULT_OVERLAYS = ("deploy/overlays/dev", "deploy/overlays/prod")


def main(argv: list[str]) -> int:
    findings = []
    for path in argv or DEFAULT_OVERLAYS:
        docs = render(Path(path))
        findings += [f"{path}: {finding}" for finding in lint(docs)]
        findings += [f"{path}: schema: {error}" for doc in docs if is_custom(doc) for error in crd_errors(doc)]
    print("\n".join(findings) or "clean")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
