#!/usr/bin/env bash
# The GPU check of issue 33 (item 6), for a machine with a CUDA GPU and NO network: in about five minutes it
# builds the 1b bench models, runs every CUDA test of the suite, merges linear, ties, dare_ties, della and slerp
# with mergesmith --cuda and mergekit 0.1.5 --cuda (one run each, alternating, with the I/O floor and the output
# check of bench/compare_mergekit.py), then linear and dare_ties again on the same machine's CPU path (no --cuda), runs
# `mergesmith tokensurgeon` (a 32k-to-50k transplant at hidden 4096) and
# `mergesmith extract-lora` with --device cuda end to end, their outputs checked (bench/device_commands.py), times
# tokensurgeon's batched OMP at a transplant's size on the device, and prints one table (also written as JSON).
#
# Usage: bench/gpu_check.sh WHEELS_DIR [options] [-- gpu_check.py options]
#   WHEELS_DIR        the wheels scripts/gpu_wheels.sh made on a machine with network (mergesmith's wheel, its
#                     dependencies', mergekit 0.1.5's); torch comes from --python, or from WHEELS_DIR if it has one
#   --minutes M       the time to keep to, the venvs included (default 5); steps that would not fit are cut,
#                     each with a "cut:" line
#   --python PY       the interpreter whose CUDA torch the venvs use (default: python3)
#   --work DIR        venvs, outputs, the JSON (default ~/.cache/mergesmith/gpu-check)
#   --size S          bench model size (default 1b; tiny with --cpu-dry-run)
#   --json PATH       where the JSON goes (default WORK/gpu_check.json)
#   --no-venv         no venvs: PY itself runs both tools, this checkout's src/ first on PYTHONPATH, and the
#                     wheels in WHEELS_DIR are unpacked with --no-deps into WORK/site (so WHEELS_DIR holds only
#                     what PY lacks, e.g. pydantic and mergekit 0.1.5 for an image that has the ML stack: a few
#                     MB where the full set is 200 MB); a mergekit-0.1.5 wheel there makes mergekit run too
#   --cpu-dry-run     the same pipeline on the CPU, without --cuda, at a tiny size, a small OMP and the commands'
#                     quick size: proves the plumbing and the table on a machine without a GPU; mergekit only if its
#                     wheels are there
#   after --, options of bench/gpu_check.py (--cases, --test-files, --omp-shared, --omp-targets, --commands-size,
#                     --commands-also-cpu, ...)
#
# How the venvs see the machine's torch without --system-site-packages: that flag would only reach the base
# interpreter's packages, and the CUDA torch often lives in a venv or conda env; so each venv gets a .pth file
# listing PY's site-packages, after its own, and pip counts PY's torch as installed. Each venv is installed with
# --no-index from WHEELS_DIR alone (no pip configuration is read) and reused while WHEELS_DIR and PY are the same.
#
# Exit status: 0 all passed; 1 a test failed, a case failed or its outputs differ; 2 bad usage or no CUDA device.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
started="$(date +%s)"

die() {
    echo "error: $*" >&2
    exit 2
}

wheels="" minutes=5 py="python3" work="$HOME/.cache/mergesmith/gpu-check" size="" json="" mode="cuda" venv=1
extra=()
while [ $# -gt 0 ]; do
    case "$1" in
    --minutes) minutes="${2:?--minutes needs a value}"; shift 2 ;;
    --python) py="${2:?--python needs a value}"; shift 2 ;;
    --work) work="${2:?--work needs a value}"; shift 2 ;;
    --size) size="${2:?--size needs a value}"; shift 2 ;;
    --json) json="${2:?--json needs a value}"; shift 2 ;;
    --cpu-dry-run) mode="cpu-dry-run"; shift ;;
    --no-venv) venv=0; shift ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    --) shift; extra=("$@"); break ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) [ -z "$wheels" ] || die "one WHEELS_DIR only (got $wheels and $1)"; wheels="$1"; shift ;;
    esac
done
[ -n "$wheels" ] || die "usage: bench/gpu_check.sh WHEELS_DIR [--minutes 5] [--cpu-dry-run] (see --help)"
[ -d "$wheels" ] || die "WHEELS_DIR $wheels is not a directory"
wheels="$(cd "$wheels" && pwd)"
[[ "$minutes" =~ ^[0-9]+([.][0-9]+)?$ ]] || die "--minutes must be a number of minutes, got $minutes"
deadline="$(awk -v s="$started" -v m="$minutes" 'BEGIN { printf "%.0f", s + 60 * m }')"
if [ -z "$size" ]; then
    if [ "$mode" = cuda ]; then size=1b; else size=tiny; fi
fi
mkdir -p "$work"
work="$(cd "$work" && pwd)"
[ -z "$json" ] || json="$(realpath -m -- "$json")"  # the check runs in the repository root

ms_wheel="$(find "$wheels" -maxdepth 1 -type f -name 'mergesmith-*.whl' | sort -V | tail -n 1)"
[ -n "$ms_wheel" ] || [ "$venv" = 0 ] || die "no mergesmith-*.whl in $wheels (make the folder with scripts/gpu_wheels.sh)"
mk_wheel="$(find "$wheels" -maxdepth 1 -type f -name 'mergekit-0.1.5-*.whl' | head -n 1)"
have_torch_wheel="$(find "$wheels" -maxdepth 1 -type f -name 'torch-*.whl' | head -n 1)"

command -v "$py" >/dev/null 2>&1 || die "--python $py: no such interpreter"
py_version="$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
if [ -f "$wheels/gpu_wheels.txt" ]; then
    want="$(sed -n 's/^python_version=//p' "$wheels/gpu_wheels.txt")"
    [ -z "$want" ] || [ "$want" = "$py_version" ] ||
        die "the wheels in $wheels are for Python $want, $py is $py_version (remake them: scripts/gpu_wheels.sh DIR --python-version $py_version)"
fi
if ! "$py" -c 'import torch' 2>/dev/null && [ -z "$have_torch_wheel" ]; then
    die "$py cannot import torch and $wheels has no torch wheel (pass the CUDA torch's python with --python)"
fi
if [ "$mode" = cuda ] && "$py" -c 'import torch' 2>/dev/null; then
    if ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
        die "torch.cuda.is_available() is False for $py (torch $("$py" -c 'import torch; print(torch.__version__)')): no GPU check run (--cpu-dry-run runs its plumbing on the CPU)"
    fi
fi

# pip reads no configuration and no PIP_* variable here: the wheels folder is the whole world
# pip_in VENV_PYTHON ARGS...: that venv's pip
pip_in() {
    env -u PIP_FIND_LINKS -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL -u PIP_CONSTRAINT -u PIP_REQUIREMENT \
        PIP_CONFIG_FILE=/dev/null PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1 "$1" -m pip "${@:2}"
}

host_site_dirs="$("$py" -c 'import sys; print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))')"

# make_venv DIR MAIN_WHEEL REQUIREMENT...: a venv on PY's torch holding MAIN_WHEEL and REQUIREMENTs from the wheels
make_venv() {
    local dir="$1" main="$2"
    shift 2
    local stamp
    stamp="$(
        cd "$wheels"
        { ls -l -- *.whl; echo "$py_version $(command -v "$py")"; echo "$host_site_dirs"; echo "$*"; } | cksum
    )"
    if [ -x "$dir/bin/python" ] && [ "$(cat "$dir/.gpu-check-stamp" 2>/dev/null)" = "$stamp" ]; then
        echo "venv $dir: ready" >&2
        return 0
    fi
    echo "venv $dir: installing from $wheels (offline) ..." >&2
    rm -rf "$dir"
    # without ensurepip (Debian's python3 lacks python3-venv's), the venv uses PY's pip through the .pth below
    "$py" -m venv "$dir" >&2 || { rm -rf "$dir" && "$py" -m venv --without-pip "$dir"; }
    local site
    site="$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    printf '%s\n' "$host_site_dirs" >"$site/_gpu_check_host.pth"
    "$dir/bin/python" -m pip --version >/dev/null 2>&1 || die "no pip for the venv $dir: $py has neither ensurepip nor pip"
    # the venv's own old setuptools (Python < 3.12 puts one in) would hide PY's, which its torch may require
    if [ -d "$site/setuptools" ]; then
        pip_in "$dir/bin/python" uninstall --yes --quiet setuptools >&2
    fi
    # the tool's own wheel even where PY has a copy of it installed (pip would call that one "satisfied")
    pip_in "$dir/bin/python" install --quiet --no-index --find-links "$wheels" --no-deps --force-reinstall "$main"
    pip_in "$dir/bin/python" install --quiet --no-index --find-links "$wheels" "$@"
    echo "$stamp" >"$dir/.gpu-check-stamp"
}

args=(--mode "$mode" --deadline "$deadline" --minutes "$minutes" --size "$size" --work "$work")
mk_py=""  # the python beside whose mergekit-yaml gpu_check.py runs mergekit
if [ "$venv" = 1 ]; then
    make_venv "$work/venv-mergesmith" "$ms_wheel" "mergesmith[hf]" pytest hypothesis
    ms_py="$work/venv-mergesmith/bin/python"
    if [ -n "$mk_wheel" ]; then
        make_venv "$work/venv-mergekit" "$mk_wheel" "mergekit==0.1.5"
        mk_py="$work/venv-mergekit/bin/python"
    fi
    unset PYTHONPATH  # the installed wheel is what is checked, not a source tree
else
    # PY as it is, plus what it lacks: every wheel but mergesmith's own (the checkout's src/ is what is checked)
    site="$work/site"
    rm -rf "$site"
    mapfile -t extra_wheels < <(find "$wheels" -maxdepth 1 -type f -name '*.whl' ! -name 'mergesmith-*.whl' | sort)
    if [ "${#extra_wheels[@]}" -gt 0 ]; then
        echo "site $site: unpacking ${#extra_wheels[@]} wheels with --no-deps (offline) ..." >&2
        pip_in "$py" install --quiet --no-index --no-deps --no-compile --target "$site" "${extra_wheels[@]}" >&2
    fi
    export PYTHONPATH="$repo/src:$site${PYTHONPATH:+:$PYTHONPATH}"
    ms_py="$(command -v "$py")"
    if [ -n "$mk_wheel" ]; then
        # gpu_check.py finds mergekit-yaml beside the python it is given: a wrapper of PY in the site's bin/
        mkdir -p "$site/bin"
        printf '#!/bin/sh\nexec %q "$@"\n' "$ms_py" >"$site/bin/python"
        chmod +x "$site/bin/python"
        [ -x "$site/bin/mergekit-yaml" ] || die "the mergekit wheel in $wheels installed no $site/bin/mergekit-yaml"
        mk_py="$site/bin/python"
    fi
fi
if [ -n "$mk_py" ]; then
    args+=(--mergekit-python "$mk_py")
else
    echo "no mergekit-0.1.5 wheel in $wheels: mergesmith alone" >&2
fi
if [ "$mode" = cuda ]; then
    "$ms_py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' ||
        die "torch.cuda.is_available() is False for $ms_py (torch $("$ms_py" -c 'import torch; print(torch.__version__)')): no GPU check run"
else
    # a small transplant: the dry run proves the plumbing, it times nothing worth quoting
    args+=(--omp-shared 4000 --omp-hidden 256 --omp-k 16 --omp-targets 256 --commands-size quick)
fi
[ -z "$json" ] || args+=(--json "$json")
args+=(--header "venvs ready after $(($(date +%s) - started)) s; wheels $wheels")

cd "$repo"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
exec "$ms_py" "$here/gpu_check.py" "${args[@]}" "${extra[@]}"
