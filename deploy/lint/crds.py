"""Schemas of the custom resources the overlays render (KEDA's ScaledObject, the Prometheus
Operator's ServiceMonitor and PodMonitor), which kubernetes-validate does not carry: vendored
as minimal JSON schemas under deploy/lint/schemas/ and checked with jsonschema."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from deploy.lint.manifests import Doc, ident

SCHEMAS = Path(__file__).resolve().parent / "schemas"
CUSTOM_GROUPS = ("keda.sh/", "monitoring.coreos.com/")


def is_custom(doc: Doc) -> bool:
    """Whether the document's kind is one of the custom resources whose schemas we vendor."""
    return str(doc.get("apiVersion", "")).startswith(CUSTOM_GROUPS)


@cache
def _validator(api_version: str, kind: str) -> Any:
    import jsonschema

    path = SCHEMAS / f"{api_version.replace('/', '_')}_{kind}.json"
    if not path.is_file():
        return None
    schema = json.loads(path.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def crd_errors(doc: Doc) -> list[str]:
    """What the vendored schema finds wrong with one custom resource, one line per error."""
    validator = _validator(str(doc.get("apiVersion")), str(doc.get("kind")))
    if validator is None:
        return [f"{ident(doc)}: no vendored schema for {doc.get('apiVersion')} {doc.get('kind')} in {SCHEMAS}"]
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    return [f"{ident(doc)}: {'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors]
