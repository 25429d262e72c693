"""Where a merge's threads spend their time: a sampling profiler for every Python thread of one command.

    python bench/sample_stacks.py [--interval-ms 5] [--top 30] [--out FILE] -m mergesmith.cli merge CFG OUT --cuda

Why by hand: cProfile sees only the thread that enables it (the executor's workers are threads, and the GPU path's
cost is in them), py-spy is not installed on the machines this runs on (a GPU machine with no package index), and
torch.profiler times kernels, not the Python that launches them. This samples sys._current_frames() from a
daemon thread every --interval-ms and, when the command ends, prints per thread group (the name without its
number) the share of samples whose innermost frame is each function ("self") and whose stack holds it
("total"). A thread blocked in C code with the GIL released is seen at the Python call that entered it, which is
what is wanted here (a wait on a lock, a file read, a CUDA synchronize show as themselves).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import runpy
import sys
import threading
import time
from types import FrameType

_NUMBERED = re.compile(r"[-_]?\d+$")


def _where(frame: FrameType) -> str:
    code = frame.f_code
    path = code.co_filename
    for marker in ("/mergesmith/", "/site-packages/", "/lib/python"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{path}:{code.co_name}"


class Sampler:
    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.samples: dict[str, int] = collections.Counter()
        self.leaf: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.inclusive: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def _run(self) -> None:
        me = threading.get_ident()
        while not self.stop.wait(self.interval_s):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                group = _NUMBERED.sub("", names.get(ident, "?")) or "?"
                self.samples[group] += 1
                self.leaf[group][_where(frame)] += 1
                seen = set()
                while frame is not None:
                    where = _where(frame)
                    if where not in seen:
                        seen.add(where)
                        self.inclusive[group][where] += 1
                    frame = frame.f_back

    def report(self, top: int, elapsed: float) -> str:
        lines = [f"sampled every {self.interval_s * 1e3:.0f} ms for {elapsed:.1f} s"]
        for group, count in sorted(self.samples.items(), key=lambda kv: -kv[1]):
            lines.append(f"\n== thread group {group!r}: {count} samples")
            lines.append("  self%  total%  function")
            ranked = sorted(self.inclusive[group].items(), key=lambda kv: -kv[1])[:top]
            for where, n in ranked:
                lines.append(f"  {100 * self.leaf[group][where] / count:5.1f}  {100 * n / count:6.1f}  {where}")
            lines.append("  by self:")
            for where, n in self.leaf[group].most_common(12):
                lines.append(f"  {100 * n / count:5.1f}  {100 * self.inclusive[group][where] / count:6.1f}  {where}")
        return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--interval-ms", type=float, default=5.0)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", default=None, help="write the report here too")
    ap.add_argument("-m", dest="module", required=True, help="the module to run, as python -m does")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    sampler = Sampler(a.interval_ms / 1e3)
    sys.argv = [a.module, *a.args]
    started = time.perf_counter()
    reported = threading.Event()

    def report() -> None:
        if reported.is_set():
            return
        reported.set()
        sampler.stop.set()
        sampler.thread.join()
        text = sampler.report(a.top, time.perf_counter() - started)
        sys.stderr.write(text)
        if a.out:
            with open(a.out, "w") as f:
                f.write(text)

    real_exit = os._exit

    def exit_after_report(status: int) -> None:  # the CLI leaves by os._exit (no slow teardown): report first
        report()
        real_exit(status)

    os._exit = exit_after_report
    sampler.thread.start()
    code = 0
    try:
        runpy.run_module(a.module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        report()
    return code


if __name__ == "__main__":
    sys.exit(main())
