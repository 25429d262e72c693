#!/usr/bin/env bash
# Quick start: install, build three tiny llama-style models on the spot (no download), merge them
# (a linear average and a passthrough frankenmerge), then load the results with transformers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh hf
venv="${MERGESMITH_VENV:-.venv}"
export HF_HUB_OFFLINE=1
"$venv/bin/python" examples/make_tiny_models.py examples/models
rm -rf demo-output
"$venv/bin/mergesmith" plan examples/linear.yml demo-output/linear
"$venv/bin/mergesmith" merge examples/linear.yml demo-output/linear
"$venv/bin/mergesmith" merge examples/frankenmerge.yml demo-output/frankenmerge
"$venv/bin/python" examples/check_output.py demo-output/linear demo-output/frankenmerge
