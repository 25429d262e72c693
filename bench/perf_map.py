"""Run a mergesmith command in this process and name numba's compiled loops for `perf`.

    perf record -F 499 -a -g -o ties.data -- python bench/perf_map.py [--load] merge CONFIG OUT -q
    perf report -i ties.data --no-children --sort sym --stdio -g none

`perf` names JIT-made code from /tmp/perf-PID.map; numba writes none, so a profile of a merge shows its loops as bare
addresses. This script runs the command (mergesmith's `main`, in-process), then writes that map: every compiled loop
the run used, by module and name, at the address numba gave it. Sizes are not known, so each entry runs to the next
one's address: a callee that numba compiled into its caller's library and the map does not name is counted as the
name before it. With `--load`, the kernel groups (`compiled.KernelGroup`) are loaded before the command runs, which
names more of them: a library numba has just compiled lists all its functions, callees included (set
NUMBA_CACHE_DIR to an empty folder to compile rather than load them), while one loaded from numba's cache shows
its entry point only. The numbers quoted in bench/README.md ("eighth session of issue 33") were read this way.

Why by hand: neither numba nor perf offers the mapping (numba's NUMBA_ENABLE_PROFILING serves other profilers).
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys
from typing import Any


def load_kernel_groups() -> None:
    """Compile or load every kernel group of mergesmith.kernels now, and wait for them."""
    import mergesmith.kernels as kernels
    from mergesmith.kernels.compiled import KernelGroup

    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"mergesmith.kernels.{info.name}")
        for value in vars(module).values():
            if isinstance(value, KernelGroup):
                value.wait()


def _library_functions(library: Any, entry: str) -> list[str]:
    """The functions a numba code library defines (its entry point alone where it was loaded from numba's cache)."""
    try:
        names = [f.name for f in library._final_module.functions if not f.is_declaration]
    except Exception:  # noqa: BLE001 - numba internals: the entry point is always known
        names = []
    return names or [entry]


def map_entries() -> list[tuple[int, str]]:
    """(address, name) of each compiled loop (and its library's other functions) made in this process so far."""
    from mergesmith.kernels import compiled

    entries: set[tuple[int, str]] = set()
    for loop in compiled._deferred:
        real = loop._real
        if real is None:
            continue
        name = f"numba:{loop.__module__.rsplit('.', 1)[-1]}.{loop.__name__}"
        for result in real.overloads.values():
            entry = result.fndesc.llvm_func_name
            for function in _library_functions(result.library, entry):
                try:
                    address = result.library.get_pointer_to_function(function)
                except Exception:  # noqa: BLE001 - a function the engine did not keep
                    continue
                if address:
                    entries.add((address, name if function == entry else f"{name}/{function[:80]}"))
    return sorted(entries)


def write_map(entries: list[tuple[int, str]], pid: int) -> str:
    """Write perf's map for process `pid`; its path."""
    path = f"/tmp/perf-{pid}.map"
    with open(path, "w") as out:
        for k, (address, name) in enumerate(entries):
            size = entries[k + 1][0] - address if k + 1 < len(entries) else 1 << 16
            out.write(f"{address:x} {min(size, 1 << 20):x} {name}\n")
    return path


def main(argv: list[str]) -> int:
    load = bool(argv) and argv[0] == "--load"
    args = argv[1:] if load else argv
    if load:
        load_kernel_groups()
    from mergesmith.cli import main as mergesmith_main

    code: Any = 0
    sys.argv = ["mergesmith", *args]
    try:
        mergesmith_main()
    except SystemExit as exc:
        code = exc.code
    entries = map_entries()
    print(f"perf map: {write_map(entries, os.getpid())} ({len(entries)} functions)", file=sys.stderr)
    return code if isinstance(code, int) else (0 if code is None else 1)


if __name__ == "__main__":
    sys.stdout.flush()
    os._exit(main(sys.argv[1:]))  # mergesmith's worker threads are daemons; leave as the command does
