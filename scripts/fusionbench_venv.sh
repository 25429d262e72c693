#!/usr/bin/env bash
# Create (or reuse) a separate virtual environment holding FusionBench (fusion-bench 0.2.33), the
# reference implementation tests/test_fusionbench_reference.py's fixtures come from
# (tests/reference/fusionbench/make_fusionbench_reference.py runs inside it).
#
# Usage: scripts/fusionbench_venv.sh           -> prints the venv's python path on its last line
#   FUSIONBENCH_VENV=/path        where to put it (default ~/.cache/mergesmith/fusionbench-venv)
#   FUSIONBENCH_TORCH_SPEC=...    the torch pin (default torch==2.13.0: on this project's machines pip's
#                                 find-links resolves it to the local CPU wheel torch-2.13.0+cpu; elsewhere
#                                 use torch==2.13.0+cpu with e.g.
#                                 PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu)
#   FUSIONBENCH_PYTHON=python3.11 the interpreter that creates the venv (default: python3)
#
# torch is installed FIRST, on its own, and then held by a constraints file while fusion-bench and its
# dependencies (hydra-core, lightning, transformers, datasets, peft, ...) are installed, so no CUDA
# torch or nvidia-* wheel is pulled. fusion-bench 0.2.33 states no torch pin, so its full dependency
# set installs against torch 2.13 as is (no --no-deps needed).
#
# Idempotent: when the venv already has fusion-bench 0.2.33 and the pinned torch, it does nothing but
# print the python path; a half-made venv is completed.
set -euo pipefail

VENV="${FUSIONBENCH_VENV:-$HOME/.cache/mergesmith/fusionbench-venv}"
TORCH_SPEC="${FUSIONBENCH_TORCH_SPEC:-torch==2.13.0}"
PY="${FUSIONBENCH_PYTHON:-python3}"
FB_VERSION="0.2.33"

want_torch="${TORCH_SPEC#torch==}"

installed_ok() {
    [ -x "$VENV/bin/python" ] || return 1
    "$VENV/bin/python" - "$want_torch" "$FB_VERSION" <<'PYEOF' >/dev/null 2>&1
import sys
from importlib.metadata import version
assert version("fusion-bench") == sys.argv[2]
torch, want = version("torch"), sys.argv[1]
# a pin without a local label (torch==2.13.0) is met by any build of it, e.g. the local 2.13.0+cpu wheel
assert torch == want or ("+" not in want and torch.split("+")[0] == want)
import fusion_bench.method  # noqa: F401  (the merge functions import)
PYEOF
}

# shellcheck source=scripts/reference_venv.sh
source "$(dirname "${BASH_SOURCE[0]}")/reference_venv.sh"
build_reference_venv fusionbench "fusion-bench==$FB_VERSION"
