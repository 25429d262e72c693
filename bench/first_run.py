"""The first TIES and DARE-TIES merges after install, with an empty compile cache, against later ones (issue 29, 4).

Why: numba compiles the kernels these methods use on their first use (2-20 s a module on this VM), and the cache
it writes makes every later process's load ~0.1-0.4 s. A merge must not wait for that compile: until the compiled
loops are ready it takes their uncompiled path (kernels/compiled.py's KernelGroup). This script measures it as a
new user meets it: each merge is a fresh `mergesmith merge` process (python and torch start-up included) on the
quick start's tiny models, and each round gets a fresh, empty NUMBA_CACHE_DIR (numba's cache is nowhere else while
that is set).

Per method and round it prints the wall time of:
- first:  the first merge with the empty cache;
- second: the next merge (the cache holds whatever the first one's background compile finished before it exited);
- warm:   a merge after the cache was filled completely (every kernel compiled by a separate process first);
- wait:   (with --old) a merge with an empty cache that waits for the compile of every group it consults
          (MERGESMITH_KERNELS=wait, as the test suite runs). The code before issue 29 also waited for groups it
          never used (TIES' replay on the tiny models); to time that code itself, run this script with its sources
          first on the path: `git archive 57778a8 src | tar -x -C /tmp/old; PYTHONPATH=/tmp/old/src python
          bench/first_run.py`.
and first - second, first - warm: the issue asks for at most 2 s.

    python bench/first_run.py                      # ties and dare_ties on the tiny models, 3 rounds
    python bench/first_run.py --rounds 1 --old     # also the old, waiting behaviour
    python bench/first_run.py --size 0.25b --rounds 1   # a merge large enough to start the compile (bench models)

The tiny models' tensors are too small to start a compile at all (compiled.START_ENTRIES); the 0.25b set's start
it, run uncompiled until the loops are ready, then compiled (`warm` is the all-compiled time).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchlib as bl  # bench/ is on the path when a script here runs

ROOT = Path(__file__).resolve().parent.parent
FILL_CACHE = (
    "from mergesmith.kernels import bf16_mix, introsort_replay, keyed_kernels\n"
    "for m in (bf16_mix, introsort_replay, keyed_kernels): m.warm()\n"
)


def _env(cache: Path, *, wait: bool = False) -> dict[str, str]:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), HF_HUB_OFFLINE="1")
    env.pop("MERGESMITH_KERNELS", None)
    if wait:
        env["MERGESMITH_KERNELS"] = "wait"
    return env


def _merge(config: Path, out: Path, env: dict[str, str]) -> float:
    """Wall seconds of one fresh `mergesmith merge` process."""
    bl.rm_out(out)
    start = time.perf_counter()
    subprocess.run(bl.mergesmith_cmd(config, out, "5B"), env=env, check=True)
    return time.perf_counter() - start


def _tiny_models(root: Path) -> list[Path]:
    subprocess.run([sys.executable, str(ROOT / "examples" / "make_tiny_models.py"), str(root)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return [root / f"tiny-llama-{i}" for i in range(3)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="ties,dare_ties")
    parser.add_argument("--rounds", type=int, default=3, help="each round starts from a fresh, empty cache")
    parser.add_argument("--size", default="tiny",
                        help="tiny (examples/make_tiny_models.py) or a bench/make_models.py size")
    parser.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "mergesmith-first-run-models",
                        help="where the tiny models are built")
    parser.add_argument("--models-root", type=Path, default=None, help="bench models' root (make_models.py --root)")
    parser.add_argument("--old", action="store_true", help="also time a merge that waits for the compile")
    args = parser.parse_args()

    if args.size == "tiny":
        models = _tiny_models(args.models)
    else:
        from make_models import DEFAULT_ROOT, ensure_models

        models = ensure_models(args.size, args.models_root or DEFAULT_ROOT)
    rows = []
    with tempfile.TemporaryDirectory(prefix="mergesmith-first-run-") as tmp:
        work = Path(tmp)
        for method in args.methods.split(","):
            config = bl.write_config(bl.make_config(method, models), work / f"{method}.yml")
            for round_ in range(args.rounds):
                cache = work / f"numba-{method}-{round_}"
                cache.mkdir()
                first = _merge(config, work / "out", _env(cache))
                second = _merge(config, work / "out", _env(cache))
                subprocess.run([sys.executable, "-c", FILL_CACHE], env=_env(cache), check=True)
                warm = _merge(config, work / "out", _env(cache))
                row = [method, str(round_ + 1), f"{first:.2f}", f"{second:.2f}", f"{warm:.2f}",
                       f"{first - second:+.2f}", f"{first - warm:+.2f}"]
                if args.old:
                    empty = work / f"numba-{method}-{round_}-old"
                    empty.mkdir()
                    row.append(f"{_merge(config, work / 'out', _env(empty, wait=True)):.2f}")
                rows.append(row)
                bl.log(" ".join(row))
    headers = ["method", "round", "first s", "second s", "warm s", "first-second", "first-warm"]
    print(bl.table([*headers, *(["wait (old) s"] if args.old else [])], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
