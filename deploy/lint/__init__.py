"""Semantic lint of rendered Kubernetes manifests: what the API schemas let through.

`kubernetes-validate --strict` checks each document's shape. These rules check the documents
against each other and against how the services behave (README settings, DESIGN.md): names,
selectors, Service and probe ports, the gateway's routing (wiring.py); namespaces and Redis
hosts (scope.py); shutdown timing against the gateway's deadline (rollout.py); NetworkPolicies against the
flows the settings imply (isolation.py, evaluated by network.py); autoscalers, monitors and GPU spreading (scaling.py); quantities, GPUs, torch
threads, secrets, security context, service links, Redis and image tags (policy.py).

Each rule takes every rendered document of one overlay and returns findings, one
"Kind/name: problem" string each; no findings means clean.

CLI: python -m deploy.lint [deploy/overlays/dev deploy/overlays/prod]
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

from deploy.lint.isolation import network_policies
from deploy.lint.manifests import Doc
from deploy.lint.policy import (
    gpus,
    images,
    no_inline_secrets,
    quantities,
    redis,
    security,
    service_links,
    torch_threads,
)
from deploy.lint.rollout import termination
from deploy.lint.scaling import autoscaling, monitoring, spread
from deploy.lint.scope import env_references, namespaces, store_targets
from deploy.lint.wiring import names, probes, routing, selectors, service_targets

Rule = Callable[[list[Doc]], list[str]]

RULES: dict[str, Rule] = {
    rule.__name__: rule
    for rule in (namespaces, names, selectors, service_targets, routing, store_targets, env_references, probes,
                 quantities, gpus, torch_threads, no_inline_secrets, termination, security, service_links, redis,
                 images, network_policies, autoscaling, monitoring, spread)
}  # fmt: skip


def lint(docs: list[Doc]) -> list[str]:
    """Every rule's findings, each prefixed with the rule's name."""
    return [f"{name}: {finding}" for name, rule in RULES.items() for finding in rule(docs)]


def render(kustomization: Path) -> list[Doc]:
    """`kubectl kustomize DIR` parsed into documents (needs kubectl and PyYAML)."""
    import yaml

    out = subprocess.run(
        ["kubectl", "kustomize", str(kustomization)], check=True, capture_output=True, text=True
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]
