# Sourced by scripts/mergekit_venv.sh and scripts/fusionbench_venv.sh: build (or complete) a separate venv that
# holds one reference implementation on the CPU torch wheel, and print its python on the last line.
#
# The caller sets VENV, PY, TORCH_SPEC and want_torch, defines `installed_ok` (true when the venv already holds
# what it needs), then calls: build_reference_venv NAME PACKAGE_SPEC
# Why one piece: both references must get torch first and alone from the CPU wheel (a missing wheel fails there
# with a clear message; a package saying only torch>=2 would otherwise pull the newest CUDA torch and its
# multi-gigabyte nvidia-* wheels), held by a constraints file, and neither may end with a CUDA package.

build_reference_venv() {
    local name="$1" spec="$2"
    if installed_ok; then
        echo "$name venv ready at $VENV" >&2
        echo "$VENV/bin/python"
        return 0
    fi
    mkdir -p "$(dirname "$VENV")"
    if [ ! -x "$VENV/bin/python" ]; then
        "$PY" -m venv "$VENV"
    fi
    _reference_constraints="$(mktemp)"
    trap 'rm -f "$_reference_constraints"' EXIT
    echo "$TORCH_SPEC" >"$_reference_constraints"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip >&2 || true
    "$VENV/bin/python" -m pip install --quiet -c "$_reference_constraints" "$TORCH_SPEC" >&2
    "$VENV/bin/python" -m pip install --quiet -c "$_reference_constraints" "$spec" >&2
    if "$VENV/bin/python" -m pip list --format=freeze 2>/dev/null | grep -i -E '^(nvidia-|triton==)' >&2; then
        echo "error: CUDA packages were installed into $VENV; check the torch pin ($TORCH_SPEC)" >&2
        return 1
    fi
    if ! installed_ok; then
        echo "error: $VENV does not hold $spec with torch $want_torch importable after install" >&2
        return 1
    fi
    echo "$name venv ready at $VENV" >&2
    echo "$VENV/bin/python"
}
