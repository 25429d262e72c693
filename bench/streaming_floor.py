"""The fastest a bf16 linear merge of these models runs here without torch: a floor for the merge's own time.

    python bench/streaming_floor.py MODEL_DIR MODEL_DIR [...] [--weights 0.5,0.3,0.2] [--runs 3] [--warm]

Why: bench/compare_mergekit.py's I/O floor reads the inputs and writes the output one after the other, inside a
process that is already running. A merge also starts a Python process, and it reads while it writes, which on this
project's VM is slower than the two apart (benchlib.overlap_floor). This script is the plainest program that does
what a streaming linear merge must, and nothing else: a fresh Python process that imports numpy, numba and
mergesmith's buffer helper only (no torch: `io.direct_write.anonymous_buffer`, huge-page buffers as the merge's own)
reads every input tensor in 8 MB row chunks by O_DIRECT (IO_THREADS threads, AHEAD chunks read ahead by each of two
workers), sums them weighted in float32 in a compiled loop and rounds to bfloat16, and writes each chunk by O_DIRECT
from one writer thread, then fsyncs. No journal, no plan, no checks, no safetensors header:
its output is not a model (each chunk lands at the next aligned offset) and is deleted. What mergesmith's linear merge
takes beyond it is what its own machinery costs, torch's import above all (bench/README.md, issue 33, tenth session).

Per run, a fresh child process: its wall time from the parent's view (Python's start-up included) and when its first
read started. Then the medians. The page cache is dropped before each run unless --warm (root only). `--check`
compares the first and the last chunk written with the same sum done by numpy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHUNK = 8 << 20
"""Bytes of one input tensor per chunk (the same size as mergesmith's direct reads and writes)."""
IO_THREADS = 6
AHEAD = 2
"""Chunks each worker has read ahead of the one it sums: 2 was the fastest of 1-3 on the project's VM."""
ALIGN = 4096


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", type=Path, help="model directories (safetensors, bf16 tensors, same names)")
    ap.add_argument("--weights", default=None, help="comma-separated weights (default: equal)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warm", action="store_true", help="keep the page cache (default: drop it before each run)")
    ap.add_argument("--check", action="store_true", help="compare two written chunks with numpy's sum")
    ap.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    weights = [float(w) for w in args.weights.split(",")] if args.weights else [1 / len(args.models)] * len(args.models)
    if len(weights) != len(args.models):
        ap.error(f"{len(weights)} weights for {len(args.models)} models")
    if args.child is not None:
        return _child(args.models, weights, args.child, args.check)
    return _parent(args, weights)


def _parent(args: argparse.Namespace, weights: list[float]) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import benchlib as bl

    walls, firsts = [], []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="streaming-floor-", dir=args.models[0].parent) as work:
            out = Path(work) / "out.bin"
            dropped = False if args.warm else bl.drop_page_cache()
            cmd = [sys.executable, __file__, *map(str, args.models), "--weights", ",".join(map(str, weights)),
                   "--child", str(out)] + (["--check"] if args.check else [])
            started = time.perf_counter()
            done = subprocess.run(cmd, capture_output=True, text=True)
            wall = time.perf_counter() - started
        if done.returncode != 0:
            last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit status {done.returncode}"
            print(last if last.startswith("error: ") else f"error: the run failed: {last}", file=sys.stderr)
            return 1
        report = json.loads(done.stdout.strip().splitlines()[-1])
        walls.append(wall)
        firsts.append(report["first_read_s"])
        check = f", check {'ok' if report['check'] else 'FAILED'}" if args.check else ""
        cache = "cache dropped" if dropped else "cache warm"
        print(f"run {run + 1}: {wall:.2f} s wall, first read {report['first_read_s']:.2f} s after the child's start, "
              f"{report['gb']:.2f} GB read, {cache}{check}")
        if args.check and not report["check"]:
            return 1
    print(f"median {statistics.median(walls):.2f} s ({min(walls):.2f}-{max(walls):.2f}), first read "
          f"{statistics.median(firsts):.2f} s, {args.runs} runs")
    return 0


def _tensors(models: list[Path]) -> list[tuple[str, list[tuple[Path, int]], int]]:
    """(name, [(file, absolute data offset) per model], byte length) of every tensor, in the first model's order."""
    found: list[dict[str, tuple[Path, int, int, str]]] = []
    for model in models:
        entries: dict[str, tuple[Path, int, int, str]] = {}
        for path in sorted(model.glob("*.safetensors")):
            with open(path, "rb") as fh:
                size = struct.unpack("<Q", fh.read(8))[0]
                header = json.loads(fh.read(size))
            for name, meta in header.items():
                if name != "__metadata__":
                    start, end = meta["data_offsets"]
                    entries[name] = (path, 8 + size + start, end - start, meta["dtype"])
        found.append(entries)
    tensors = []
    for name, (_, _, length, dtype) in found[0].items():
        if dtype != "BF16":
            raise SystemExit(f"error: {name}: {dtype}; this floor sums bf16 tensors only")
        refs = []
        for entries, model in zip(found, models):
            if name not in entries or entries[name][2] != length:
                raise SystemExit(f"error: {model}: no tensor {name} of {length} bytes")
            refs.append((entries[name][0], entries[name][1]))
        tensors.append((name, refs, length))
    return tensors


def _child(models: list[Path], weights: list[float], out_path: Path, check: bool) -> int:
    started = time.monotonic() - _seconds_since_process_start()
    import mmap
    import queue
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import numba
    import numpy as np

    from mergesmith.io.direct_write import anonymous_buffer  # mergesmith's own buffers: huge pages where granted

    @numba.njit(nogil=True, cache=True)
    def accumulate(bits, weight, first, widened, total):  # total (+)= weight * bits widened to float32
        as_bits = widened.view(np.uint32)
        for i in range(total.shape[0]):
            as_bits[i] = np.uint32(bits[i]) << np.uint32(16)
        if first:
            for i in range(total.shape[0]):
                total[i] = widened[i] * weight
        else:
            for i in range(total.shape[0]):
                total[i] = total[i] + widened[i] * weight

    @numba.njit(nogil=True, cache=True)
    def narrow(total, out):  # round to nearest even bfloat16 (no nan in a floor's sums)
        as_bits = total.view(np.uint32)
        for i in range(out.shape[0]):
            u = as_bits[i]
            out[i] = np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))

    jobs = [(refs, offset, min(CHUNK, length - offset)) for _, refs, length in _tensors(models)
            for offset in range(0, length, CHUNK)]
    places = []  # each chunk's aligned offset in the output
    position = 0
    for _, _, n in jobs:
        places.append(position)
        position += -(-n // ALIGN) * ALIGN
    descriptors: dict[Path, int] = {}
    lock = threading.Lock()

    def descriptor(path: Path) -> int:
        with lock:
            if path not in descriptors:
                descriptors[path] = os.open(path, os.O_RDONLY | os.O_DIRECT)
            return descriptors[path]

    def read(ref: tuple[Path, int], offset: int, n: int, buffer: mmap.mmap) -> int:
        start = ref[1] + offset
        lo, hi = start // ALIGN * ALIGN, -(-(start + n) // ALIGN) * ALIGN
        got = os.preadv(descriptor(ref[0]), [memoryview(buffer)[: hi - lo]], lo)
        if got < start + n - lo:
            raise OSError(f"{ref[0]}: short read at {lo}")
        return start - lo

    out_fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    reader = ThreadPoolExecutor(IO_THREADS)
    writes: queue.Queue = queue.Queue(maxsize=4)
    free: queue.Queue = queue.Queue()
    for _ in range(6):
        free.put(anonymous_buffer(CHUNK))
    first_read: list[float] = []
    failed: list[BaseException] = []

    def writer() -> None:
        while (item := writes.get()) is not None:
            buffer, n, place = item
            try:
                os.pwrite(out_fd, memoryview(buffer)[: -(-n // ALIGN) * ALIGN], place)
            except BaseException as exc:  # noqa: BLE001 - reported by the child's exit
                failed.append(exc)
            free.put(buffer)

    def work(mine: list[int]) -> None:
        sets = [[anonymous_buffer(CHUNK + 2 * ALIGN) for _ in models] for _ in range(AHEAD + 1)]
        widened = np.empty(CHUNK // 2, np.float32)
        total = np.empty(CHUNK // 2, np.float32)
        pending = []

        def submit(k: int) -> None:
            refs, offset, n = jobs[mine[k]]
            pending.append([reader.submit(read, ref, offset, n, buf) for ref, buf in zip(refs, sets[k % (AHEAD + 1)])])

        for k in range(min(AHEAD, len(mine))):
            submit(k)
        if not first_read:
            first_read.append(time.monotonic() - started)
        for k, index in enumerate(mine):
            if k + AHEAD < len(mine):
                submit(k + AHEAD)
            skips = [future.result() for future in pending.pop(0)]
            n = jobs[index][2]
            for m, (buf, skip) in enumerate(zip(sets[k % (AHEAD + 1)], skips)):
                bits = np.frombuffer(buf, np.uint16, n // 2, skip)
                accumulate(bits, np.float32(weights[m]), m == 0, widened[: n // 2], total[: n // 2])
            out = free.get()
            narrow(total[: n // 2], np.frombuffer(out, np.uint16, n // 2))
            writes.put((out, n, places[index]))

    thread = threading.Thread(target=writer)
    thread.start()
    with ThreadPoolExecutor(2) as workers:
        list(workers.map(work, [list(range(len(jobs)))[0::2], list(range(len(jobs)))[1::2]]))
    writes.put(None)
    thread.join()
    os.fsync(out_fd)
    os.close(out_fd)
    if failed:
        raise failed[0]
    ok = _check(jobs, places, weights, out_path) if check else None
    os.unlink(out_path)
    print(json.dumps({"first_read_s": first_read[0] if first_read else None, "check": ok,
                      "gb": sum(n for _, _, n in jobs) * len(models) / 1e9}))
    return 0


def _check(jobs: list, places: list[int], weights: list[float], out_path: Path) -> bool:
    """The first and last chunks as written, against numpy's float32 sum of the inputs rounded the same way."""
    import numpy as np

    for index in {0, len(jobs) - 1}:
        refs, offset, n = jobs[index]
        total = None
        for (path, start), weight in zip(refs, weights):
            with open(path, "rb") as fh:
                fh.seek(start + offset)
                bits = np.frombuffer(fh.read(n), np.uint16)
            term = (bits.astype(np.uint32) << 16).view(np.float32) * np.float32(weight)
            total = term if total is None else total + term
        u = total.view(np.uint32)
        expected = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        with open(out_path, "rb") as fh:
            fh.seek(places[index])
            written = np.frombuffer(fh.read(n), np.uint16)
        if not np.array_equal(written, expected):
            return False
    return True


def _seconds_since_process_start() -> float:
    with open("/proc/self/stat") as fh:
        ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as fh:
        uptime = float(fh.read().split()[0])
    return uptime - ticks / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    sys.exit(main())
