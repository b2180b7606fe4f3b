"""The trained tiny shapes family (issue 13): a base and three fine-tunes, `color`, `count` and
`shape`, that share one vision tower and answer one question each about images of the synthetic
task in task.py. Trained by `python -m model_builders.shapes` and shipped in models/shapes/.
"""

from __future__ import annotations

from pathlib import Path

FAMILY_DIR = Path(__file__).resolve().parents[2] / "models" / "shapes"
FINETUNES = ("color", "count", "shape")


def trained_family(root: Path = FAMILY_DIR) -> dict[str, Path]:
    """{"base", "color", "count", "shape"} -> checkpoint dir; raises when the family is missing."""
    members = {name: root / name for name in ("base", *FINETUNES)}
    missing = [name for name, path in members.items() if not (path / "config.json").is_file()]
    if missing:
        raise FileNotFoundError(
            f"trained checkpoints {missing} not found under {root}: they ship with the repository "
            "(git lfs is not used); rebuild with `python -m model_builders.shapes --out models/shapes`"
        )
    return members
