#!/usr/bin/env bash
# The GPU measurements in one command, on a host with Python 3.12, torch and transformers but no
# network and no Redis: installs what it lacks from bench/gpu/wheelhouse (prepare.sh builds it),
# starts that wheelhouse's redis-server, builds the checkpoints there (random weights) and runs
# `python -m bench.gpu`. Results: JSON + Markdown in $OUT (the run tool's folder) and in
# bench/gpu/results/. Arguments go to bench.gpu (`--device cpu --quick` rehearses on a CPU).
#
#   bash bench/gpu/run.sh [--device cuda] [--quick] ...
#   PYTHON=/path/to/python3.12   the host interpreter that has torch (default: python3.12, python3)
#   WORK=/tmp/vlm-gpu-bench      venv, checkpoints and logs (default: a fresh temp dir)
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
wheelhouse="$repo/bench/gpu/wheelhouse"
results="$repo/bench/gpu/results"
out=${OUT:-$results}
work=${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/vlm-gpu-bench.XXXXXX")}
# The whole script's limit (the run tool allows 600 s): bench.gpu skips parts that would end
# later than 30 s before it (--budget-s); the timeout only catches a hang.
deadline_s=${DEADLINE_S:-570}
started=$(date +%s)

step() { echo "[$(($(date +%s) - started))s] $*"; }

pick_python() {
    local candidate
    for candidate in "${PYTHON:-}" python3.12 python3 python /opt/conda/bin/python; do
        if [ -n "$candidate" ] && command -v "$candidate" >/dev/null \
            && "$candidate" -c 'import torch, transformers' 2>/dev/null; then
            command -v "$candidate"
            return
        fi
    done
    echo "no Python with torch and transformers found (set PYTHON)" >&2
    return 1
}

[ -d "$wheelhouse" ] || { echo "no $wheelhouse: run bench/gpu/prepare.sh first and carry it" >&2; exit 1; }
host_python=$(pick_python)
mkdir -p "$work" "$out"
step "host Python: $host_python ($("$host_python" -c 'import sys, torch, transformers; print(sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__)'))"

# Only the wheelhouse: unset the pip settings of the machine this runs on (index, find-links).
for name in $(compgen -e); do
    case $name in PIP_*) unset "$name" ;; esac
done
export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
pip_wheel=$(ls "$wheelhouse"/pip-*.whl | head -n 1)  # pip runs from its wheel: the host may have none
requirements="$repo/bench/gpu/requirements.txt"

# A venv over the host's packages, so that pip installs only what the host lacks or has too old:
# --system-site-packages sees a system or conda Python's packages; a host Python that is itself a
# venv keeps its own out of that, so a .pth file names them too. --without-pip: no ensurepip needed.
venv="$work/venv"
path_first=""
if "$host_python" -m venv --without-pip --system-site-packages "$venv"; then
    python="$venv/bin/python"
    site_dir=$("$python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
    "$host_python" -c 'import site, sys; sys.prefix != sys.base_prefix and print("\n".join(site.getsitepackages()))' \
        > "$site_dir/host-site-packages.pth"
    step "installing what the host lacks from the wheelhouse"
    "$python" "$pip_wheel/pip" install --quiet --no-index --find-links "$wheelhouse" -r "$requirements"
else
    # No venv module: everything in requirements.txt goes to a folder put first on the path.
    python="$host_python"
    site_dir="$work/site"
    path_first="$site_dir:"
    step "no venv on the host; installing the whole wheelhouse into $site_dir"
    "$python" "$pip_wheel/pip" install --quiet --no-index --find-links "$wheelhouse" --target "$site_dir" -r "$requirements"
fi
"$python" "$pip_wheel/pip" list --path "$site_dir" --format freeze > "$work/installed-from-wheelhouse.txt"
step "installed: $(tr '\n' ' ' < "$work/installed-from-wheelhouse.txt")"

# No network on the host: never let transformers or the hub try it.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 HF_HUB_DISABLE_PROGRESS_BARS=1
export PATH="$wheelhouse/bin:$PATH" PYTHONPATH="$path_first$repo" PYTHONUNBUFFERED=1
cd "$repo"
step "python -m bench.gpu --out $out --work $work $*"
status=0
left=$((deadline_s - $(date +%s) + started))
timeout --kill-after=15 "$left" "$python" -m bench.gpu --out "$out" --work "$work" --budget-s $((left - 30)) "$@" \
    || status=$?
cp "$work/installed-from-wheelhouse.txt" "$out/" 2>/dev/null || true
cp -r "$work/logs" "$out/" 2>/dev/null || true  # the encoder service's log
if [ "$out" != "$results" ]; then
    mkdir -p "$results" && cp "$out"/*.json "$out"/*.md "$results/" 2>/dev/null || true
fi
step "done (exit $status); results in $out"
exit "$status"
