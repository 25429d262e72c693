"""When each tensor of a merge ran, and on which worker: a timeline of the executor's recipes.

    python bench/recipe_trace.py [--min-s 0.15] [--cold] -- CONFIG OUT_DIR [merge options]

Why: a profile says where CPU time goes, not when a worker sat idle, nor why. This wraps the local executor's
per-recipe call (`LocalExecutor._run_one`, which computes and writes one tensor), runs `mergesmith merge` in this
process, and prints each recipe's start, end, duration, worker and working-memory cost, in order of start (those
that took at least --min-s, and the automatic memory budget they ran under). A gap in one worker's lines while the
other runs a long recipe is a wait: the 1b TIES merge showed its second worker idle 0.7 s, twice, while the
embedding's and the output matrix's selections held their lent ids (bench/README.md, issue 33, sixth session).
Times are from the start of the command's run, after this script's own imports (torch's among them).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import benchlib as bl


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--min-s", type=float, default=0.15, help="print recipes that took at least this long")
    ap.add_argument("--cold", action="store_true", help="drop the page cache first (root only)")
    ap.add_argument("merge_args", nargs=argparse.REMAINDER, help="after --: the arguments of `mergesmith merge`")
    args = ap.parse_args()
    merge_args = [a for a in args.merge_args if a != "--"]
    if len(merge_args) < 2:
        ap.error("give the merge's CONFIG and OUT_DIR after --")

    import mergesmith.cli as cli
    from mergesmith.engine.execution import local_executor

    spans: list[tuple[float, float, str, str, int]] = []
    budgets: list[int | None] = []
    run_one = local_executor.LocalExecutor._run_one
    run = local_executor.LocalExecutor.run

    def traced_run_one(self, shard, recipe, cost, slots, device_cost=0):  # noqa: ANN001, ANN202 - the wrapped call's
        begun = time.perf_counter()
        try:
            return run_one(self, shard, recipe, cost, slots, device_cost)
        finally:
            spans.append((begun - start, time.perf_counter() - start, threading.current_thread().name, recipe.name,
                          cost))

    def traced_run(self):  # noqa: ANN001, ANN202
        try:
            return run(self)
        finally:
            budgets.append(self.budget.limit)

    local_executor.LocalExecutor._run_one = traced_run_one
    local_executor.LocalExecutor.run = traced_run
    if args.cold:
        bl.rm_out(Path(merge_args[1]))
        bl.drop_page_cache()
    sys.argv = ["mergesmith", "merge", *merge_args]
    start = time.perf_counter()
    code = 0
    try:
        cli.main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    limit = budgets[-1] if budgets else None
    print(f"automatic budget: {limit / 1e6:.0f} MB" if limit else "budget: none")
    print(f"{'start':>7} {'end':>7} {'took':>6}  {'worker':10} recipe (cost)")
    for begun, ended, worker, name, cost in sorted(spans):
        if ended - begun >= args.min_s:
            print(f"{begun:7.2f} {ended:7.2f} {ended - begun:6.2f}  {worker:10} {name} ({cost / 1e6:.0f} MB)")
    return code


if __name__ == "__main__":
    sys.exit(main())
