#!/usr/bin/env bash
# Install mergesmith with its test dependencies into .venv, then run ruff and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh test
venv="${MERGESMITH_VENV:-.venv}"
export HF_HUB_OFFLINE=1
"$venv/bin/ruff" check src tests bench examples
"$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
