"""CPU time the NaN/inf check (engine/execution/nonfinite.py) spends during a merge, against the merge's whole CPU time.

    python bench/nonfinite_cost.py CONFIG.yml RUNS [OUT_DIR]

Runs the merge in this process RUNS times (`--threads 2`, OUT_DIR removed before each run, default
/tmp/mergesmith-nonfinite-bench), timing every count_nonfinite call with the calling thread's CPU clock.
"""

import resource
import shutil
import sys
import threading
import time

from mergesmith.engine.execution import nonfinite

spent = [0.0, 0]
lock = threading.Lock()
original = nonfinite.count_nonfinite


def timed(tensor):
    t = time.thread_time()
    try:
        return original(tensor)
    finally:
        with lock:
            spent[0] += time.thread_time() - t
            spent[1] += tensor.numel() * tensor.element_size() if tensor.is_floating_point() else 0


nonfinite.count_nonfinite = timed
from mergesmith.cli import main  # noqa: E402

out = sys.argv[3] if len(sys.argv) > 3 else "/tmp/mergesmith-nonfinite-bench"
for run in range(int(sys.argv[2])):
    shutil.rmtree(out, ignore_errors=True)
    spent[:] = [0.0, 0]
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    w0 = time.perf_counter()
    try:
        main(["merge", sys.argv[1], out, "-q", "--threads", "2"])
    except SystemExit as e:
        assert e.code == 0, e.code
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    wall = time.perf_counter() - w0
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    print(
        f"run {run}: merge wall {wall:.2f}s, process CPU {cpu:.2f}s; check CPU {spent[0]:.3f}s over "
        f"{spent[1] / 1e9:.2f} GB ({spent[0] / cpu * 100:.1f}% of the CPU)",
        flush=True,
    )
