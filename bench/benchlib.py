"""Shared machinery of the benchmarks: timed child processes, the I/O floor, merge configs, output comparison, tables.

Kept in one module so ``bench_merge.py`` (mergesmith alone) and ``compare_mergekit.py`` (mergesmith vs mergekit)
measure in exactly the same way; a figure in one table means the same thing as in the other.

Measurement choices (why):

* Each merge is a fresh process, started by a tiny launcher that reaps it with ``os.wait4``, which returns *that*
  child's rusage: CPU time, peak RSS (``ru_maxrss``) and the bytes it made the block layer read/write
  (``ru_inblock``/``ru_oublock``, 512-byte units, which count mmap page-ins too). ``RUSAGE_CHILDREN`` would give the
  max over all children so far, not per run; the launcher keeps this process's own RSS out of the figure (see
  `LAUNCHER`).
* Peak RSS counts resident file-backed pages of mmapped inputs, which the kernel can drop at will; so a sampler also
  records the peak of ``RssAnon`` (private memory the process really needs) from ``/proc/PID/status`` every 50 ms.
* The page cache is dropped before every run and before the floor is measured when we can (root), so every run
  reads from disk the same way; the table says whether that happened.
* mergekit does not fsync its output, mergesmith does; so every run is followed by a timed ``sync`` and the
  "wall+sync" figure (time until the output is on disk) is the fair one to compare and to divide by the floor.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
DEFAULT_OUT_ROOT = Path(os.environ.get("MERGESMITH_BENCH_OUT", Path.home() / ".cache/mergesmith/bench-out"))
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
GB = 1e9


# --------------------------------------------------------------------------------------------------- page cache


def drop_page_cache() -> bool:
    """Flush dirty pages and drop the page cache; False when not permitted (not root, read-only /proc/sys)."""
    os.sync()
    try:
        DROP_CACHES.write_text("3\n")
    except OSError:
        return False
    return True


def can_drop_caches() -> bool:
    """Whether `drop_page_cache` works here (tried once, for real)."""
    return drop_page_cache()


# --------------------------------------------------------------------------------------------------- child runs


@dataclass
class RunResult:
    """One timed merge process."""

    wall_s: float
    sync_s: float
    user_s: float
    sys_s: float
    maxrss: int  # bytes, kernel high-water mark of the child's RSS (includes mapped file pages)
    peak_anon: int  # bytes, sampled peak of RssAnon (private memory)
    read_bytes: int  # bytes the block layer read for the child (0 when everything came from the page cache)
    write_bytes: int  # bytes the child wrote (dirtied) to files
    returncode: int
    cold: bool  # page cache dropped before the run
    load1: float = 0.0  # 1-minute load average when the run started (the machine is shared: a noise indicator)
    output_bytes: int = 0
    stderr_tail: str = ""

    @property
    def cpu_s(self) -> float:
        return self.user_s + self.sys_s

    @property
    def total_s(self) -> float:
        """Until the output is durable: process wall time plus the sync that follows it."""
        return self.wall_s + self.sync_s


def read_anon(pid: int) -> int:
    """A process's resident anonymous memory in bytes (`RssAnon`), 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


class _AnonSampler(threading.Thread):
    """Polls a pid's RssAnon until told to stop; cheap enough (one small /proc read) not to disturb the run."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.interval = interval
        self.peak = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.peak = max(self.peak, read_anon(self.pid))
            self._stop_event.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def dir_bytes(path: Path) -> int:
    """Total size of the regular files under `path` (0 if it does not exist)."""
    if not path.exists():
        return 0
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# Runs the measured command as its own child and reports that child's rusage. Why a launcher: on exec, Linux folds
# the RSS of the address space being replaced into the new program's ``ru_maxrss``, and a child forked (or vforked)
# from this process starts with *our* address space -- which, after comparing two mmapped outputs, is gigabytes.
# Forked from this ~10 MB interpreter instead, the inherited figure is far below any merge's own peak, and
# ``ru_maxrss`` is a max, so it no longer shows.
LAUNCHER = r"""
import json, os, sys, time
out, procs, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
if procs != "-":  # join a memory cgroup first (bench_7b_cgroup.py): the tool exec'd from the fork starts inside it
    with open(procs, "w") as fh:
        fh.write(str(os.getpid()))
t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, 1)
        os.execvp(argv[0], argv)
    finally:
        os._exit(127)
sys.stdout.write(f"{pid}\n")
sys.stdout.flush()
_, status, ru = os.wait4(pid, 0)
wall = time.perf_counter() - t0
with open(out, "w") as fh:
    json.dump({"wall": wall, "status": status, "code": os.waitstatus_to_exitcode(status), "utime": ru.ru_utime,
               "stime": ru.ru_stime, "maxrss_kb": ru.ru_maxrss, "inblock": ru.ru_inblock,
               "oublock": ru.ru_oublock}, fh)
"""


def run_timed(
    cmd: Sequence[str], *, cold: bool, env: dict[str, str] | None = None, out_dir: Path | None = None,
    timeout: float | None = None,
) -> RunResult:
    """Run `cmd` as a fresh process (through `LAUNCHER`) and measure it; raises on a non-zero exit.

    With `timeout` (seconds), the launcher and the command (its own process group) are killed when it passes and
    `subprocess.TimeoutExpired` is raised: how a step that must keep to a deadline times a command that may not."""
    dropped = drop_page_cache() if cold else False
    full_env = dict(os.environ)
    full_env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"})
    if env:
        full_env.update(env)
    DEFAULT_OUT_ROOT.mkdir(parents=True, exist_ok=True)
    errlog = DEFAULT_OUT_ROOT / f".stderr-{os.getpid()}.log"
    usage_file = DEFAULT_OUT_ROOT / f".rusage-{os.getpid()}.json"
    usage_file.unlink(missing_ok=True)
    load1 = os.getloadavg()[0]
    with open(errlog, "wb") as err:
        launcher = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", LAUNCHER, str(usage_file), "-", *cmd],
            stdout=subprocess.PIPE, stderr=err, env=full_env, start_new_session=timeout is not None,
        )
        assert launcher.stdout is not None
        line = launcher.stdout.readline()
        sampler = _AnonSampler(int(line)) if line.strip() else None
        if sampler:
            sampler.start()
        try:
            launcher.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)  # the launcher and the command it forked
            launcher.wait()
            errlog.unlink(missing_ok=True)
            raise
        finally:
            if sampler:
                sampler.stop()
    t1 = time.perf_counter()
    os.sync()
    sync_s = time.perf_counter() - t1
    tail = errlog.read_text(errors="replace")[-3000:]
    errlog.unlink(missing_ok=True)
    if launcher.returncode != 0 or not usage_file.exists():
        raise RuntimeError(f"launcher failed ({launcher.returncode}) for: {' '.join(cmd)}\n{tail}")
    ru = json.loads(usage_file.read_text())
    usage_file.unlink()
    result = RunResult(
        wall_s=ru["wall"],
        sync_s=sync_s,
        user_s=ru["utime"],
        sys_s=ru["stime"],
        maxrss=ru["maxrss_kb"] * 1024,
        peak_anon=sampler.peak if sampler else 0,
        read_bytes=ru["inblock"] * 512,
        write_bytes=ru["oublock"] * 512,
        returncode=ru["code"],
        cold=dropped,
        load1=load1,
        output_bytes=dir_bytes(out_dir) if out_dir else 0,
        stderr_tail=tail,
    )
    if result.returncode != 0:
        raise RuntimeError(f"command failed with exit code {result.returncode}: {' '.join(cmd)}\n{tail}")
    return result


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


@dataclass
class Summary:
    """Medians over the runs of one (tool, case)."""

    runs: list[RunResult] = field(default_factory=list)

    def med(self, attr: str) -> float:
        return median([float(getattr(r, attr)) for r in self.runs])

    @property
    def n(self) -> int:
        return len(self.runs)


# --------------------------------------------------------------------------------------------------- I/O floor


@dataclass
class Floor:
    """The I/O floor of a merge: read every input byte once (cold) + write the output bytes once (fsync)."""

    read_bytes: int
    read_s: float
    write_bytes: int
    write_s: float
    cold: bool
    overlap_s: float | None = None  # reading and writing at once: what a merge that overlaps them can reach

    @property
    def total_s(self) -> float:
        return self.read_s + self.write_s


def weight_files(model_dir: Path) -> list[Path]:
    """The weight files of a model directory (what a merge must read)."""
    return sorted(p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())


def read_floor(files: Sequence[Path], *, cold: bool, block: int = 16 << 20) -> tuple[int, float, bool]:
    """Seconds to read `files` once, cache dropped first: the faster of a sequential `cat` with large reads
    and O_DIRECT reads with READ_DEPTH in flight (mergesmith's reader, so a `cat`-only floor would flatter it)."""
    dropped = drop_page_cache() if cold else False
    buf = bytearray(block)
    view = memoryview(buf)
    total = 0
    t0 = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as fh:
            while True:
                n = fh.readinto(view)
                if not n:
                    break
                total += n
    best = time.perf_counter() - t0
    if hasattr(os, "O_DIRECT"):
        if cold:
            drop_page_cache()
        try:
            best = min(best, _timed_direct_read(files))
        except OSError:  # e.g. tmpfs refuses O_DIRECT
            pass
    return total, best, dropped


READ_DEPTH = 4
"""O_DIRECT reads in flight in the read floor, as mergesmith's input reader keeps (io.direct_read.IO_THREADS)."""


def _timed_direct_read(files: Sequence[Path], piece: int = 8 << 20) -> float:
    """Seconds to read `files` with O_DIRECT, READ_DEPTH pieces at a time, into reused aligned buffers."""
    from concurrent.futures import ThreadPoolExecutor

    from mergesmith.io.direct_write import anonymous_buffer  # mergesmith's own buffers: huge pages where granted

    jobs = [(path, offset) for path in files for offset in range(0, path.stat().st_size, piece)]
    fds = {path: os.open(path, os.O_RDONLY | os.O_DIRECT) for path in files}
    buffers = [anonymous_buffer(piece) for _ in range(READ_DEPTH)]

    def read(index: int) -> None:
        for path, offset in jobs[index::READ_DEPTH]:
            os.preadv(fds[path], [buffers[index]], offset)

    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(READ_DEPTH) as pool:
            list(pool.map(read, range(READ_DEPTH)))
        return time.perf_counter() - t0
    finally:
        for fd in fds.values():
            os.close(fd)


def overlap_floor(input_files: Sequence[Path], output_bytes: int, directory: Path, *, cold: bool) -> float | None:
    """Seconds to read every input once (O_DIRECT, READ_DEPTH in flight) while writing the output bytes (O_DIRECT,
    fsync'ed) at the same time: the bound of a merge that overlaps reading and writing perfectly. On a disk whose
    reads and writes share one budget it is close to the read and write floors summed. None without O_DIRECT."""
    import threading

    if not hasattr(os, "O_DIRECT"):
        return None
    if cold:
        drop_page_cache()
    result: list[float] = []
    writer = threading.Thread(target=lambda: result.append(_timed_write(output_bytes, directory, 8 << 20, direct=True)))
    t0 = time.perf_counter()
    try:
        writer.start()
        _timed_direct_read(input_files)
        writer.join()
    except OSError:
        return None
    return time.perf_counter() - t0 if result else None


def write_floor(nbytes: int, directory: Path, *, block: int = 16 << 20) -> float:
    """Seconds to write `nbytes` of incompressible data to a new file in `directory` and fsync it: the faster
    of buffered writes and, where the filesystem takes it, O_DIRECT writes (mergesmith's writer uses the
    latter, so a buffered-only floor would flatter it)."""
    times = [_timed_write(nbytes, directory, block, direct=False)]
    if hasattr(os, "O_DIRECT"):
        try:
            times.append(_timed_write(nbytes, directory, block, direct=True))
        except OSError:  # e.g. tmpfs refuses O_DIRECT
            pass
    return min(times)


def _timed_write(nbytes: int, directory: Path, block: int, *, direct: bool) -> float:
    from mergesmith.io.direct_write import anonymous_buffer

    directory.mkdir(parents=True, exist_ok=True)
    # page-aligned, as O_DIRECT needs, and in huge pages where granted as mergesmith's writer's are: with 4 KB pages
    # a request carries at most max_segments pages (1 MB on the project's VM), and the floor measured the 1b bench's
    # reads at 4.0-5.5 s where they take 1.8-2.0 s (bench/README.md, issue 33, fifth session)
    chunk = anonymous_buffer(block)
    chunk.write(os.urandom(block))
    path = directory / f".floor-{os.getpid()}.bin"
    os.sync()  # start with no one else's dirty pages in the way
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    aligned = nbytes // 4096 * 4096 if direct else nbytes
    t0 = time.perf_counter()
    try:
        fd = os.open(path, flags, 0o644)
        try:
            offset = 0
            while offset < aligned:
                offset += os.pwrite(fd, memoryview(chunk)[: min(block, aligned - offset)], offset)
            if offset < nbytes:  # the unaligned tail, through the page cache
                with open(path, "r+b") as tail:
                    tail.seek(offset)
                    tail.write(bytes(nbytes - offset))
                    tail.flush()
                    os.fsync(tail.fileno())
            os.fsync(fd)
        finally:
            os.close(fd)
        return time.perf_counter() - t0
    finally:
        path.unlink(missing_ok=True)


def measure_floor(input_files: Sequence[Path], output_bytes: int, out_root: Path, *, cold: bool, runs: int) -> Floor:
    """Median over `runs` of the read floor and of the write floor (measured separately, then summed), and of
    the two at once (overlap_floor)."""
    reads: list[float] = []
    writes: list[float] = []
    overlaps: list[float] = []
    nread = 0
    dropped = cold
    for _ in range(max(1, runs)):
        nread, secs, d = read_floor(input_files, cold=cold)
        dropped = dropped and d
        reads.append(secs)
        writes.append(write_floor(output_bytes, out_root))
        both = overlap_floor(input_files, output_bytes, out_root, cold=cold)
        if both is not None:
            overlaps.append(both)
    return Floor(nread, median(reads), output_bytes, median(writes), dropped, median(overlaps) if overlaps else None)


def import_torch_s(python: Path | str, *, cold: bool, runs: int = 3) -> float:
    """Median seconds for `python -c "import torch"` (cache dropped first when `cold`): a start-up cost every
    run of either tool pays and the I/O floor does not contain."""
    times = []
    for _ in range(max(1, runs)):
        if cold:
            drop_page_cache()
        t0 = time.perf_counter()
        subprocess.run([str(python), "-c", "import torch"], check=True)
        times.append(time.perf_counter() - t0)
    return median(times)


# --------------------------------------------------------------------------------------------------- configs


def _layers(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["num_hidden_layers"])


def make_config(case: str, models: Sequence[Path], dtype: str = "bfloat16") -> dict[str, Any]:
    """The mergekit-format config of a benchmark case (the same YAML goes to both tools).

    `dtype` is the compute/load dtype mergekit configs name; with ``float32`` the output is still bf16
    (``out_dtype``), which is how people ask for full-precision arithmetic.
    """
    m0, m1, m2 = (str(m) for m in models[:3])
    head: dict[str, Any] = {"dtype": dtype}
    if dtype != "bfloat16":
        head["out_dtype"] = "bfloat16"
    if case == "linear":
        return {
            "merge_method": "linear",
            "models": [
                {"model": m0, "parameters": {"weight": 0.5}},
                {"model": m1, "parameters": {"weight": 0.3}},
                {"model": m2, "parameters": {"weight": 0.2}},
            ],
            **head,
        }
    if case == "ties":
        return {
            "merge_method": "ties",
            "base_model": m0,
            "models": [
                {"model": m1, "parameters": {"density": 0.5, "weight": 0.5}},
                {"model": m2, "parameters": {"density": 0.5, "weight": 0.5}},
            ],
            "parameters": {"normalize": True},
            **head,
        }
    if case == "dare_ties":
        return {
            "merge_method": "dare_ties",
            "base_model": m0,
            "models": [
                {"model": m1, "parameters": {"density": 0.5, "weight": 0.5}},
                {"model": m2, "parameters": {"density": 0.5, "weight": 0.5}},
            ],
            "parameters": {"normalize": True},
            **head,
        }
    if case in ("dare_linear", "della", "della_linear"):  # the other randomised task-vector methods (issue 21)
        extra = {"epsilon": 0.1} if case.startswith("della") else {}
        return {
            "merge_method": case,
            "base_model": m0,
            "models": [
                {"model": m1, "parameters": {"density": 0.5, "weight": 0.5, **extra}},
                {"model": m2, "parameters": {"density": 0.5, "weight": 0.5, **extra}},
            ],
            **({"parameters": {"normalize": True}} if case == "della" else {}),
            **head,
        }
    if case in ("tsv", "iso_c", "iso_cts"):  # the SVD methods (issue 32): mergesmith only, at their defaults
        return {
            "merge_method": case,
            "base_model": m0,
            "models": [{"model": m1}, {"model": m2}],
            **head,
        }
    if case == "slerp":
        layers = _layers(models[0])
        return {
            "merge_method": "slerp",
            "base_model": m0,
            "slices": [
                {
                    "sources": [
                        {"model": m0, "layer_range": [0, layers]},
                        {"model": m1, "layer_range": [0, layers]},
                    ]
                }
            ],
            "parameters": {
                "t": [
                    {"filter": "self_attn", "value": [0, 0.5, 0.3, 0.7, 1]},
                    {"filter": "mlp", "value": [1, 0.5, 0.7, 0.3, 0]},
                    {"value": 0.5},
                ]
            },
            **head,
        }
    if case == "passthrough":
        # A frankenmerge: the first 3/4 of the layers, then the last 3/4 again, so the middle half is duplicated.
        layers = _layers(models[0])
        return {
            "merge_method": "passthrough",
            "slices": [
                {"sources": [{"model": m0, "layer_range": [0, (3 * layers) // 4]}]},
                {"sources": [{"model": m0, "layer_range": [layers // 4, layers]}]},
            ],
            **head,
        }
    raise ValueError(f"unknown case {case!r}")


def config_models(config: dict[str, Any]) -> list[Path]:
    """The distinct model directories a config reads (to know which files the I/O floor must read)."""
    found: list[str] = []
    if "base_model" in config:
        found.append(config["base_model"])
    for entry in config.get("models", []):
        found.append(entry["model"])
    for sl in config.get("slices", []):
        for src in sl["sources"]:
            found.append(src["model"])
    return [Path(p) for p in dict.fromkeys(found)]


def write_config(config: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


# --------------------------------------------------------------------------------------------------- tools


@functools.cache
def compile_bytecode() -> None:
    """Write the bytecode of this checkout's mergesmith, once per bench process. Why: `pip install` of a wheel
    writes every module's bytecode, but an editable install leaves it to the first import, and where
    PYTHONDONTWRITEBYTECODE is set (this project's VMs set it) every run compiled mergesmith's ~130 modules again
    (~0.1 s of its start-up), which mergekit's pip-installed venv never does. scripts/bootstrap.sh does the same."""
    import compileall

    import mergesmith

    compileall.compile_dir(str(Path(mergesmith.__file__).parent), quiet=1)


def mergesmith_exe() -> list[str]:
    """The mergesmith command of this venv, as a user runs it (its console script; `python -m` where none), its
    bytecode written first (compile_bytecode)."""
    compile_bytecode()
    exe = Path(sys.executable).parent / "mergesmith"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "mergesmith.cli"]


def mergesmith_cmd(config: Path, out: Path, shard_size: str, extra: Sequence[str] = ()) -> list[str]:
    """The mergesmith CLI of this venv, quiet, no tokenizer (the generated models have none)."""
    return [*mergesmith_exe(), "merge", str(config), str(out), "-q", "--no-copy-tokenizer", "--out-shard-size",
            shard_size, "--random-seed", "0", *extra]


def mergesmith_methods() -> list[str]:
    """Methods the installed mergesmith registers now (others are skipped with a note)."""
    out = subprocess.run(
        [sys.executable, "-c", "from mergesmith.methods import method_names; print(' '.join(method_names()))"],
        check=True, capture_output=True, text=True,
    )
    return out.stdout.split()


def rm_out(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------------------------------- output check


@dataclass
class Diff:
    """Tensor-by-tensor comparison of two merged checkpoints."""

    tensors: int = 0
    exact: int = 0  # tensors that are bit-identical
    elements: int = 0
    differing: int = 0  # elements that are not bit-identical
    out_of_tol: int = 0
    max_abs: float = 0.0
    worst: str = ""
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)  # shape or dtype differs
    randomised: bool = False  # compared by statistics of the task vectors, not elementwise (see compare_randomised)
    worst_rms_ratio: float = 1.0  # the rms(a - base) / rms(b - base) furthest from 1
    min_corr: float = 1.0  # the lowest correlation between the two task vectors

    @property
    def ok(self) -> bool:
        return not (self.only_a or self.only_b or self.mismatched or self.out_of_tol)

    def verdict(self) -> str:
        if self.ok:
            if self.randomised:
                return f"alike (random draws; rms ratio {self.worst_rms_ratio:.3f}, corr >= {self.min_corr:.2f})"
            if self.exact == self.tensors:
                return "bit-equal"
            return f"within tol ({100 * self.differing / max(1, self.elements):.1f}% elems differ)"
        parts = []
        if self.only_a or self.only_b:
            parts.append(f"names differ ({len(self.only_a)}/{len(self.only_b)})")
        if self.mismatched:
            parts.append(f"{len(self.mismatched)} shape/dtype")
        if self.out_of_tol:
            parts.append(f"{self.out_of_tol} out of tol")
        return "DIFFERENT: " + ", ".join(parts)


def _tensor_index(model_dir: Path) -> dict[str, Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        wm = json.loads(index.read_text())["weight_map"]
        return {k: model_dir / v for k, v in wm.items()}
    from safetensors import safe_open

    out: dict[str, Path] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            out.update(dict.fromkeys(fh.keys(), f))
    return out


def compare_outputs(a: Path, b: Path, *, rtol: float = 2.0**-6) -> Diff:
    """Compare every tensor of two outputs, within bf16 tolerance; report the largest absolute difference.

    Elementwise check, in float32: |x - y| <= rtol * (|y| + rms(y)), rtol = 2^-6 (about two bf16 ulps). The rms term
    scales the absolute tolerance to the tensor's own magnitude: two correct implementations that round
    intermediate products differently (bf16 vs fp32 accumulation) differ by a fraction of an ulp of the *inputs*,
    which near zero (after cancellation) is many ulps of the *result*; a plain relative check would flag that, a
    real bug (wrong weight, wrong layer) would still fail this one by orders of magnitude.
    """
    import torch
    from safetensors import safe_open

    ia, ib = _tensor_index(a), _tensor_index(b)
    diff = Diff(only_a=sorted(set(ia) - set(ib)), only_b=sorted(set(ib) - set(ia)))
    handles: dict[Path, Any] = {}

    def get(path: Path, name: str) -> torch.Tensor:
        if path not in handles:
            handles[path] = safe_open(str(path), "pt")
        return handles[path].get_tensor(name)

    for name in sorted(set(ia) & set(ib)):
        x, y = get(ia[name], name), get(ib[name], name)
        diff.tensors += 1
        if x.shape != y.shape or x.dtype != y.dtype:
            diff.mismatched.append(name)
            continue
        diff.elements += y.numel()
        if torch.equal(x, y):
            diff.exact += 1
            continue
        xf, yf = x.float(), y.float()
        d = (xf - yf).abs()
        diff.differing += int((d > 0).sum())
        m = float(d.max())
        if m > diff.max_abs:
            diff.max_abs, diff.worst = m, name
        rms = float(yf.square().mean().sqrt())
        if not bool((d <= rtol * (yf.abs() + rms)).all()):
            diff.out_of_tol += 1
    return diff


def compare_randomised(a: Path, b: Path, base: Path, *, rms_tol: float = 0.1, min_corr: float = 0.2) -> Diff:
    """Compare two outputs of a randomised method (DARE, DELLA): each tool draws its own drop masks, so no element
    need match. What must match is the distribution: per tensor, the task vectors ``a - base`` and ``b - base`` have
    the same rms within ``rms_tol`` (relative; a wrong density, rescale or weight moves it by far more) and are
    positively correlated (both keep a random half of the same deltas with the same consensus sign; a sign error or
    a wrong model gives ~0 or negative). Tensors the method leaves equal to the base compare exactly.
    """
    import torch
    from safetensors import safe_open

    ia, ib, i0 = _tensor_index(a), _tensor_index(b), _tensor_index(base)
    diff = Diff(only_a=sorted(set(ia) - set(ib)), only_b=sorted(set(ib) - set(ia)), randomised=True)
    handles: dict[Path, Any] = {}

    def get(path: Path, name: str) -> torch.Tensor:
        if path not in handles:
            handles[path] = safe_open(str(path), "pt")
        return handles[path].get_tensor(name).float()

    for name in sorted(set(ia) & set(ib)):
        x, y = get(ia[name], name), get(ib[name], name)
        diff.tensors += 1
        if x.shape != y.shape or name not in i0:
            diff.mismatched.append(name)
            continue
        diff.elements += y.numel()
        if y.numel() == 0:
            diff.exact += 1
            continue
        d = (x - y).abs()
        diff.differing += int((d > 0).sum())
        if float(d.max()) > diff.max_abs:
            diff.max_abs, diff.worst = float(d.max()), name
        tx, ty = x - get(i0[name], name), y - get(i0[name], name)
        rx, ry = float(tx.square().mean().sqrt()), float(ty.square().mean().sqrt())
        if rx == 0.0 and ry == 0.0:
            diff.exact += 1
            continue
        ratio = rx / ry if ry else float("inf")
        corr = float(torch.nn.functional.cosine_similarity(tx.flatten(), ty.flatten(), dim=0))
        if abs(ratio - 1) > abs(diff.worst_rms_ratio - 1):
            diff.worst_rms_ratio = ratio
        diff.min_corr = min(diff.min_corr, corr)
        # a few hundred entries (a norm's weights) keep few enough that the rms of two independent draws differs
        # by chance: 4 standard deviations of the rms ratio, ~sqrt(1/n) each (tiny della: 0.80 on 256 entries)
        if abs(ratio - 1) > max(rms_tol, 4 / math.sqrt(y.numel())) or corr < min_corr:
            diff.out_of_tol += 1
    return diff


# --------------------------------------------------------------------------------------------------- printing


def fmt_bytes(n: float) -> str:
    if n != n:  # nan
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.2f} {unit}" if unit in ("GB", "TB") else f"{n:.0f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def fmt_s(x: float) -> str:
    return "-" if x != x else f"{x:.1f}"


def fmt_ratio(x: float) -> str:
    return "-" if x != x else f"{x:.2f}x"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain aligned text table (first column left-aligned, the rest right-aligned), pasteable anywhere."""
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *(line(r) for r in rows)])


def log(msg: str) -> None:
    """Progress lines go to stderr so stdout holds only the tables."""
    print(msg, file=sys.stderr, flush=True)


DETAIL_HEADERS = [
    "tool/case", "runs", "wall s", "wall+sync s", "cpu s", "cpu/wall", "peak RSS", "peak anon", "input",
    "disk read", "disk write", "output", "floor r+w s", "r||w s", "x floor", "GB/s", "load",
]


def detail_row(label: str, s: Summary, floor: Floor) -> list[str]:
    """One line of the per-tool detail table (medians over runs); see bench/README.md for the columns."""
    total = s.med("total_s")
    return [
        label,
        str(s.n),
        fmt_s(s.med("wall_s")),
        fmt_s(total),
        fmt_s(s.med("cpu_s")),
        f"{s.med('cpu_s') / s.med('wall_s'):.2f}",
        fmt_bytes(s.med("maxrss")),
        fmt_bytes(s.med("peak_anon")),
        fmt_bytes(floor.read_bytes),
        fmt_bytes(s.med("read_bytes")),
        fmt_bytes(s.med("write_bytes")),
        fmt_bytes(s.med("output_bytes")),
        f"{fmt_s(floor.read_s)}+{fmt_s(floor.write_s)}",
        fmt_s(floor.overlap_s) if floor.overlap_s is not None else "-",
        fmt_ratio(total / floor.total_s),
        f"{(floor.read_bytes + s.med('output_bytes')) / total / GB:.2f}",
        f"{s.med('load1'):.1f}",
    ]
