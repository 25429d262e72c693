#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install mergesmith into it.
#   scripts/bootstrap.sh [extra]   e.g. "test" or "hf"
# The CPU build of torch is installed first and pinned, so pip never pulls gigabytes of CUDA
# packages on a machine without a GPU; the package itself declares only torch>=2.2.
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-hf}"
venv="${MERGESMITH_VENV:-.venv}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
stamp="$venv/.mergesmith-installed-$extra"
want="$(cat pyproject.toml | sha256sum | cut -c1-16)"
# The editable install below writes no bytecode, and where PYTHONDONTWRITEBYTECODE is set (as on this project's
# VMs) Python never writes it either: every command then compiled ~130 modules again (~0.1 s of each start-up).
# Written here, as `pip install` of a wheel does; up-to-date files are skipped, so a rerun costs a few stats.
compile_bytecode() { "$venv/bin/python" -m compileall -q src/mergesmith >/dev/null || true; }
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  compile_bytecode
  exit 0
fi
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  echo "installing torch (CPU build)..." >&2
  "${pip[@]}" install "torch==2.13.0"
fi
echo "installing mergesmith[$extra]..." >&2
"${pip[@]}" install -e ".[$extra]"
echo "$want" > "$stamp"
compile_bytecode
