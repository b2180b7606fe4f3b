"""Reading rendered manifests: workloads, containers, env, selectors, quantities."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

Doc = dict[str, Any]

WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet")
QUANTITY = re.compile(r"([+-]?(?:\d+(?:\.\d*)?|\.\d+))(e[+-]?\d+|E[+-]?\d+|Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?")
SUFFIXES = {
    None: Decimal(1), "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"),
    "k": Decimal(10) ** 3, "M": Decimal(10) ** 6, "G": Decimal(10) ** 9, "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15, "E": Decimal(10) ** 18, "Ki": Decimal(2) ** 10, "Mi": Decimal(2) ** 20,
    "Gi": Decimal(2) ** 30, "Ti": Decimal(2) ** 40, "Pi": Decimal(2) ** 50, "Ei": Decimal(2) ** 60,
}  # fmt: skip


def ident(doc: Doc) -> str:
    return f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"


def namespace(doc: Doc) -> str:
    return doc.get("metadata", {}).get("namespace", "default")


def of_kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d.get("kind") == kind]


def workloads(docs: list[Doc]) -> list[Doc]:
    return [d for d in docs if d.get("kind") in WORKLOAD_KINDS]


def pod_spec(workload: Doc) -> Doc:
    return workload["spec"]["template"]["spec"]


def pod_labels(workload: Doc) -> dict[str, str]:
    return workload["spec"]["template"].get("metadata", {}).get("labels", {})


def containers(workload: Doc, init: bool = True) -> list[Doc]:
    spec = pod_spec(workload)
    return [*spec.get("containers", []), *(spec.get("initContainers", []) if init else [])]


def env(container: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in container.get("env", [])}


def env_value(container: Doc, name: str) -> str | None:
    return env(container).get(name, {}).get("value")


def selected(docs: list[Doc], selector_doc: Doc, selector: dict[str, str]) -> list[Doc]:
    """Workloads in selector_doc's namespace whose pod labels include every pair of selector."""
    return [
        w for w in workloads(docs)
        if namespace(w) == namespace(selector_doc) and selector and selector.items() <= pod_labels(w).items()
    ]  # fmt: skip


def parse_quantity(value: object) -> Decimal:
    """A Kubernetes resource.Quantity as a number ("500m" -> 0.5, "2Gi" -> 2147483648)."""
    match = QUANTITY.fullmatch(str(value).strip())
    if not match:
        raise ValueError(f"{value!r} is not a quantity")
    number, suffix = match.groups()
    try:
        if suffix and suffix[0] in "eE":
            return Decimal(number + suffix)
        return Decimal(number) * SUFFIXES[suffix]
    except InvalidOperation as error:
        raise ValueError(f"{value!r} is not a quantity") from error


def label_selector_matches(selector: Doc | None, labels: dict[str, str]) -> bool:
    if not selector or not (selector.get("matchLabels") or selector.get("matchExpressions")):
        return False  # an empty selector selects nothing in a Deployment and everything in a PDB: never meant
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"In": labels.get(key) in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]  # fmt: skip
        if not ok:
            return False
    return True


def covered_by(docs: list[Doc], doc: Doc) -> list[Doc]:
    """Workloads a PDB's label selector covers."""
    sel = doc["spec"].get("selector")
    return [w for w in workloads(docs) if namespace(w) == namespace(doc) and label_selector_matches(sel, pod_labels(w))]
