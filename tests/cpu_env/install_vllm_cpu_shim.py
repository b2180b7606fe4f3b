"""Installs vllm_cpu_shim into the running interpreter's site-packages with a .pth hook.

Usage (inside the venv): python tests/cpu_env/install_vllm_cpu_shim.py
"""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    site_packages = Path(sysconfig.get_paths()["purelib"])
    shutil.copy(HERE / "vllm_cpu_shim.py", site_packages / "vllm_cpu_shim.py")
    (site_packages / "vllm_cpu_shim.pth").write_text("import vllm_cpu_shim; vllm_cpu_shim.install()\n")
    print(f"installed vllm_cpu_shim into {site_packages}")


if __name__ == "__main__":
    main()
