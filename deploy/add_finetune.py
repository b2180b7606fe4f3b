"""Adds one fine-tune to the deployment: `python deploy/add_finetune.py NAME [--checkpoint PATH]`.

It writes deploy/base/finetunes/NAME/kustomization.yaml (the LLM service template as
Deployment/Service/PDB llm-NAME serving model NAME from PATH, default /models/NAME, and a
ScaledObject llm-NAME on its own queue), lists it
in deploy/base/finetunes/kustomization.yaml, and routes model NAME to its headless Service in
deploy/base/routing/models.json. Both overlays pick it up; `python -m deploy.lint` and
tests/test_deploy.py check that the three agree.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

DEPLOY = Path(__file__).resolve().parent
NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
LLM_PORT = 50061

TEMPLATE = """\
# Fine-tune {name}: the LLM service template as Deployment/Service/PDB/ScaledObject llm-{name}.
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - ../../llm
nameSuffix: -{name}
labels:
  - pairs:
      app.kubernetes.io/instance: llm-{name}
    includeSelectors: true
patches:
  - target:
      kind: Deployment
    patch: |-
      apiVersion: apps/v1
      kind: Deployment
      metadata:
        name: llm
      spec:
        template:
          spec:
            containers:
              - name: llm
                env:
                  - name: LLM_MODEL_NAME
                    value: {name}
                  - name: LLM_CHECKPOINT
                    value: {checkpoint}
  # Autoscale on this fine-tune's own queue (the Service's name is the series' `service` label).
  - target:
      kind: ScaledObject
    patch: |-
      - op: replace
        path: /spec/triggers/0/metadata/query
        value: sum(llm_requests_waiting{{namespace="{namespace}",service="llm-{name}"}})
"""


def finetune_kustomization(name: str, checkpoint: str, namespace: str = "vlm") -> str:
    return TEMPLATE.format(name=name, checkpoint=checkpoint, namespace=namespace)


def base_namespace(deploy: Path) -> str:
    match = re.search(r"^namespace:\s*(\S+)", (deploy / "base" / "kustomization.yaml").read_text(), re.MULTILINE)
    if not match:
        raise SystemExit("deploy/base/kustomization.yaml sets no namespace")
    return match.group(1)


def add_finetune(name: str, checkpoint: str | None = None, deploy: Path = DEPLOY) -> None:
    """Writes the fine-tune's folder, lists it, routes it; refuses a bad or existing name."""
    if not NAME.fullmatch(name) or len(f"llm-{name}") > 63:
        raise SystemExit(f"{name!r}: use lowercase letters, digits and '-', at most 59 characters")
    folder = deploy / "base" / "finetunes" / name
    listing = deploy / "base" / "finetunes" / "kustomization.yaml"
    routing = deploy / "base" / "routing" / "models.json"
    models = json.loads(routing.read_text())
    if folder.exists() or name in models:
        raise SystemExit(f"fine-tune {name!r} already exists")
    folder.mkdir()
    kustomization = finetune_kustomization(name, checkpoint or f"/models/{name}", base_namespace(deploy))
    (folder / "kustomization.yaml").write_text(kustomization)
    listing.write_text(listing.read_text().rstrip("\n") + f"\n  - {name}\n")
    models[name] = [f"dns:///llm-{name}.{base_namespace(deploy)}.svc.cluster.local:{LLM_PORT}"]
    routing.write_text(_routes_json(models))


def _routes_json(models: dict[str, list[str]]) -> str:
    """One model per line, as the checked-in file is written."""
    lines = [f"  {json.dumps(model)}: {json.dumps(targets)}" for model, targets in sorted(models.items())]
    return "{\n" + ",\n".join(lines) + "\n}\n"


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", help="model name clients use; the service becomes llm-NAME")
    parser.add_argument("--checkpoint", help="checkpoint path in the pods (default /models/NAME)")
    args = parser.parse_args(argv)
    add_finetune(args.name, args.checkpoint)
    print(f"added fine-tune {args.name}: deploy/base/finetunes/{args.name}/, routed in deploy/base/routing/models.json")


if __name__ == "__main__":
    main(sys.argv[1:])
