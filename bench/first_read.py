"""How long a merge takes to start reading its inputs: the start-up that the I/O floor does not contain.

    python bench/first_read.py CONFIG [--src A_SRC --src B_SRC] [--runs 5] [--warm]

Each run is a fresh `python` that records when the process started (from /proc), wraps `os.preadv` (the input
feed's direct reads, io/direct_read.py; nothing else in a merge calls it) to note its first call, and runs
`mergesmith merge CONFIG OUT -q` in-process. It prints, per run, seconds from the process's start to the first
input read and to the end, then the medians. With several `--src` (source trees, e.g. a `git worktree` of another
commit, put first on PYTHONPATH) the runs alternate between them, so a disk that speeds up or slows down over the
minutes is shared. The page cache is dropped before each run unless `--warm` (needs root).

Why by hand: the merge's own progress says nothing about the time before it starts, and an strace of the reads
slows the merge (every traced read stops the process) while this costs one Python call per read.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import benchlib as bl

_CHILD = r"""
import os, sys, time
now = time.time()
with open("/proc/self/stat") as f:
    ticks = int(f.read().rsplit(")", 1)[1].split()[19])
with open("/proc/uptime") as f:
    uptime = float(f.read().split()[0])
origin = now - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
first = []
plain = os.preadv
def preadv(*args, **kwargs):
    if not first:
        first.append(time.time())
    return plain(*args, **kwargs)
os.preadv = preadv
sys.argv = ["mergesmith", "merge", sys.argv[1], sys.argv[2], "-q"]
from mergesmith.cli import main
try:
    main()
except SystemExit as done:
    if done.code:
        raise
print(f"{(first[0] if first else float('nan')) - origin:.3f} {time.time() - origin:.3f}")
"""


def one_run(config: Path, src: str | None, cold: bool) -> tuple[float, float]:
    """(seconds to the first input read, seconds to the end) of one merge in a fresh process."""
    out = Path(tempfile.mkdtemp(prefix="first-read-")) / "out"
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    if cold:
        bl.drop_page_cache()
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD, str(config), str(out)], env=env, check=True,
                              capture_output=True, text=True)
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)
    first, end = (float(x) for x in done.stdout.split()[-2:])
    return first, end


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", type=Path)
    ap.add_argument("--src", action="append", default=[], help="a source tree to run (repeatable; default: installed)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--warm", action="store_true", help="leave the page cache as it is")
    args = ap.parse_args()
    trees = args.src or [None]
    results: dict[str | None, list[tuple[float, float]]] = {tree: [] for tree in trees}
    for i in range(args.runs):
        for tree in trees if i % 2 == 0 else list(reversed(trees)):
            first, end = one_run(args.config, tree, cold=not args.warm)
            results[tree].append((first, end))
            print(f"run {i + 1} {tree or 'installed'}: first read {first:.2f} s, end {end:.2f} s", flush=True)
    for tree, runs in results.items():
        firsts, ends = [r[0] for r in runs], [r[1] for r in runs]
        print(f"{tree or 'installed'}: median first read {statistics.median(firsts):.2f} s "
              f"({min(firsts):.2f}-{max(firsts):.2f}), end {statistics.median(ends):.2f} s "
              f"({min(ends):.2f}-{max(ends):.2f}), {len(runs)} runs, cache {'warm' if args.warm else 'dropped'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
