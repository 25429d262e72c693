#!/usr/bin/env bash
# Create (or reuse) a separate virtual environment holding mergekit 0.1.5, the reference
# implementation mergesmith's outputs are compared against.
#
# Usage: scripts/mergekit_venv.sh            -> prints the venv's python path on its last line
#   MERGEKIT_VENV=/path       where to put it (default ~/.cache/mergesmith/mergekit-venv)
#   MERGEKIT_TORCH_SPEC=...   the torch pin (default torch==2.13.0+cpu, the CPU-only build, so no
#                             CUDA wheels are pulled; a CPU wheel must be reachable: a local
#                             find-links folder or e.g. PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu)
#   MERGEKIT_PYTHON=python3.11  the interpreter that creates the venv (default: python3)
#   MERGEKIT_EXTRAS=evolve    mergekit's extras to install too (comma-separated; default none). `evolve`
#                             (cma, lm-eval, ray, wandb) is needed to import mergekit-evolve, e.g. for
#                             scripts/mergekit_flags.py, which lists every command's flags
#
# On this project's machines the default torch pin resolves to the local wheel torch-2.13.0+cpu (pip's
# find-links); elsewhere give a CPU wheel index as said above.
#
# Idempotent: when the venv already has mergekit 0.1.5 and the pinned torch, it does nothing but
# print the python path; a half-made venv is completed. Other scripts (benchmarks, fixture
# regeneration) call this and read the last line of its output.
set -euo pipefail

VENV="${MERGEKIT_VENV:-$HOME/.cache/mergesmith/mergekit-venv}"
TORCH_SPEC="${MERGEKIT_TORCH_SPEC:-torch==2.13.0+cpu}"
PY="${MERGEKIT_PYTHON:-python3}"
EXTRAS="${MERGEKIT_EXTRAS:-}"
MERGEKIT_SPEC="mergekit${EXTRAS:+[$EXTRAS]}==0.1.5"

want_torch="${TORCH_SPEC#torch==}"

installed_ok() {
    [ -x "$VENV/bin/python" ] || return 1
    "$VENV/bin/python" - "$want_torch" "$EXTRAS" <<'EOF' >/dev/null 2>&1
import re
import sys
from importlib.metadata import requires, version
assert version("mergekit") == "0.1.5"
torch, want = version("torch"), sys.argv[1]
# a pin without a local label (torch==2.13.0) is met by any build of it, e.g. the local 2.13.0+cpu wheel
assert torch == want or ("+" not in want and torch.split("+")[0] == want)
for extra in filter(None, sys.argv[2].split(",")):  # every requirement of each extra asked for is installed
    for req in requires("mergekit") or []:
        if re.search(rf"extra\s*==\s*['\"]{re.escape(extra.strip())}['\"]", req):
            version(re.split(r"[ ;<>=!~\[]", req, maxsplit=1)[0])
EOF
}

# shellcheck source=scripts/reference_venv.sh
source "$(dirname "${BASH_SOURCE[0]}")/reference_venv.sh"
build_reference_venv mergekit "$MERGEKIT_SPEC"
