#!/usr/bin/env bash
# Fill a folder with every wheel bench/gpu_check.sh needs on a GPU machine that reaches no package index:
# mergesmith's own wheel (built from this checkout), its dependencies' (the `hf` extra, pytest and hypothesis for
# the CUDA tests), and mergekit 0.1.5's with its dependencies, all for the GPU machine's Python on manylinux x86_64.
# Run it where the package registries are reachable, then copy the folder over (see bench/README.md).
#
# Usage: scripts/gpu_wheels.sh DIR [--python-version 3.11] [--platform manylinux_2_28_x86_64]
#                                  [--torch-version 2.13.0] [--with-torch]
#   --python-version X.Y   the GPU machine's Python (default: this machine's python3)
#   --platform TAG         its platform tag (default manylinux_2_28_x86_64; pip also takes older manylinux wheels)
#   --torch-version V      the torch the GPU machine has (default 2.13.0, this project's pin): the other packages'
#                          versions are resolved as if that torch were installed
#   --only SPECS           only these requirements (comma-separated, e.g. pydantic==2.14.4,mergekit==0.1.5), each
#                          without its dependencies, and no mergesmith wheel: for `bench/gpu_check.sh --no-venv` on
#                          a GPU image that holds the rest (bench/README.md names the few the workplace image lacks)
#   --with-torch           also download torch V itself, the CUDA build PyPI serves for Linux, with its nvidia-*
#                          and triton wheels (several GB; without it the machine's own CUDA torch is used)
#   GPU_WHEELS_PYTHON=python3  the interpreter whose pip downloads and builds
#
# Why torch is left out by default: every GPU machine comes with a CUDA torch matched to its driver, and the CUDA
# wheels are gigabytes. pip cannot be told "resolve, but do not fetch torch", so the resolution runs against a
# stand-in: an empty wheel named torch V+gpucheckstub, offered from a temporary folder and pinned by a constraint;
# it is deleted from DIR afterwards. The end writes DIR/gpu_wheels.txt (Python version, platform, torch, each
# wheel) and prints the folder's size.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${GPU_WHEELS_PYTHON:-python3}"

die() {
    echo "error: $*" >&2
    exit 2
}

dir="" platform="manylinux_2_28_x86_64" torch_version="2.13.0" with_torch=0 only=""
python_version="$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
while [ $# -gt 0 ]; do
    case "$1" in
    --python-version) python_version="${2:?--python-version needs a value}"; shift 2 ;;
    --platform) platform="${2:?--platform needs a value}"; shift 2 ;;
    --torch-version) torch_version="${2:?--torch-version needs a value}"; shift 2 ;;
    --with-torch) with_torch=1; shift ;;
    --only) only="${2:?--only needs a comma-separated list}"; shift 2 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) [ -z "$dir" ] || die "one DIR only (got $dir and $1)"; dir="$1"; shift ;;
    esac
done
[ -n "$dir" ] || die "usage: scripts/gpu_wheels.sh DIR [--python-version 3.11] [--with-torch] (see --help)"
[[ "$python_version" =~ ^3\.[0-9]+$ ]] || die "--python-version must look like 3.11, got $python_version"
[[ "$torch_version" =~ ^[0-9]+(\.[0-9]+)*$ ]] || die "--torch-version must be a plain version like 2.13.0"
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# a manylinux_2_N machine also runs every older manylinux wheel; pip (before 24) only takes the tags it is given
platforms=(--platform "$platform")
if [[ "$platform" =~ ^manylinux_2_([0-9]+)_(.+)$ ]]; then
    glibc="${BASH_REMATCH[1]}" arch="${BASH_REMATCH[2]}"
    for ((m = glibc - 1; m >= 5; m--)); do
        platforms+=(--platform "manylinux_2_${m}_${arch}")
    done
    [ "$glibc" -lt 17 ] || platforms+=(--platform "manylinux2014_${arch}")
    [ "$glibc" -lt 12 ] || platforms+=(--platform "manylinux2010_${arch}")
    platforms+=(--platform "manylinux1_${arch}")
fi
target=(--only-binary=:all: "${platforms[@]}" --python-version "$python_version" --implementation cp
    --abi "cp${python_version/./}" -d "$dir")

if [ -n "$only" ]; then
    IFS=, read -r -a specs <<<"$only"
    echo "only ${specs[*]}, without dependencies, for Python $python_version $platform ..." >&2
    env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null "$py" -m pip download --quiet --no-deps "${target[@]}" \
        "${specs[@]}" >&2
    { echo "python_version=$python_version"; echo "platform=$platform"; echo "only=$only"
      (cd "$dir" && ls -1 -- *.whl); } >"$dir/gpu_wheels.txt"
    echo "$dir: $(find "$dir" -maxdepth 1 -name '*.whl' | wc -l) wheels, $(du -sh "$dir" | cut -f1) (bench/gpu_check.sh $dir --no-venv)"
    exit 0
fi

echo "mergesmith: building its wheel from $repo ..." >&2
rm -f "$dir"/mergesmith-*.whl
"$py" -m pip wheel --quiet --no-deps -w "$dir" "$repo" >&2
ms_wheel="$(find "$dir" -maxdepth 1 -name 'mergesmith-*.whl' | head -n 1)"
[ -n "$ms_wheel" ] || die "pip wheel made no mergesmith wheel in $dir"

if [ "$with_torch" = 1 ]; then
    # the registry's torch (CUDA on Linux), never a local +cpu build a find-links folder may hold
    echo "torch==$torch_version" >"$tmp/constraints.txt"
    download() {
        env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null "$py" -m pip download --quiet "${target[@]}" \
            -c "$tmp/constraints.txt" "$@" >&2
    }
else
    stub="torch-${torch_version}+gpucheckstub-py3-none-any.whl"
    "$py" - "$tmp/stub" "$stub" "$torch_version" <<'EOF'
import base64, hashlib, sys, zipfile
from pathlib import Path

folder, name, version = Path(sys.argv[1]), sys.argv[2], sys.argv[3] + "+gpucheckstub"
folder.mkdir()
info = f"torch-{version}.dist-info"
files = {
    f"{info}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n",
    f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: gpu_wheels.sh\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
record = [f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(t.encode()).digest()).rstrip(b'=').decode()},"
          f"{len(t.encode())}" for n, t in files.items()]
files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
with zipfile.ZipFile(folder / name, "w") as zf:
    for n, t in files.items():
        zf.writestr(n, t)
EOF
    echo "torch==${torch_version}+gpucheckstub" >"$tmp/constraints.txt"
    download() {
        "$py" -m pip download --quiet "${target[@]}" --find-links "$tmp/stub" -c "$tmp/constraints.txt" "$@" >&2
    }
fi

echo "mergesmith's dependencies for Python $python_version $platform ..." >&2
download "${ms_wheel}[hf]" pytest hypothesis
echo "mergekit 0.1.5 and its dependencies ..." >&2
download "mergekit==0.1.5"
rm -f "$dir"/torch-*+gpucheckstub-*.whl
if [ "$with_torch" = 1 ] && find "$dir" -maxdepth 1 -name 'torch-*+cpu*.whl' | grep -q .; then
    die "a CPU-only torch wheel landed in $dir; remove it and give the registry's CUDA torch a way in"
fi

{
    echo "python_version=$python_version"
    echo "platform=$platform"
    if [ "$with_torch" = 1 ]; then echo "torch=$torch_version (included)"; else echo "torch=$torch_version (not included: the GPU machine's own)"; fi
    echo "made=$(date -u +%Y-%m-%dT%H:%M:%SZ) from $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo '?')"
    (cd "$dir" && ls -1 -- *.whl)
} >"$dir/gpu_wheels.txt"
count="$(find "$dir" -maxdepth 1 -name '*.whl' | wc -l)"
echo "$dir: $count wheels, $(du -sh "$dir" | cut -f1) (copy it to the GPU machine; bench/gpu_check.sh $dir)"
