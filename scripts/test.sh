#!/usr/bin/env bash
# Install mergesmith with its test dependencies into .venv, then run ruff and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh test
venv="${MERGESMITH_VENV:-.venv}"
export HF_HUB_OFFLINE=1
"$venv/bin/ruff" check src tests bench examples
# one pytest worker per core (pytest-xdist): the suite builds and merges many small models
"$venv/bin/python" -m pytest -q -p no:cacheprovider -n "${MERGESMITH_TEST_WORKERS:-auto}" "$@"
