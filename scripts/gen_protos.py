"""Generates the gRPC stubs under shared/pb from proto/ (the one way to make them).

protoc writes absolute imports (`from encoder.v1 import encoder_pb2`); we rewrite
them to `shared.pb.encoder.v1` so the stubs live inside our package.
Usage: python scripts/gen_protos.py [--out DIR]   (DIR defaults to shared/pb)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "proto"
PACKAGE_PREFIX = "shared.pb"
PROTO_PACKAGES = ("encoder", "llm")


def generate(out_dir: Path) -> list[Path]:
    """Runs protoc for every .proto file and returns the files written."""
    import grpc_tools

    proto_files = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *proto_files,
    ]
    out_dir.mkdir(parents=True, exist_ok=True)
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    written = sorted(p for p in out_dir.rglob("*") if p.suffix in (".py", ".pyi"))
    for path in written:
        path.write_text(_rewrite_imports(path.read_text()))
    for path in written:
        folder = path.parent
        while folder != out_dir.parent:
            (folder / "__init__.py").touch()
            folder = folder.parent
    return written


def _rewrite_imports(source: str) -> str:
    packages = "|".join(PROTO_PACKAGES)
    return re.sub(rf"^from ({packages})(\.\S+)? import", rf"from {PACKAGE_PREFIX}.\1\2 import", source, flags=re.M)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "shared" / "pb")
    written = generate(parser.parse_args().out)
    print(f"wrote {len(written)} files", file=sys.stderr)


if __name__ == "__main__":
    main()
