"""numba, where it is installed: what the compiled loops of this package share.

Why a module of its own: keyed_kernels.py (DARE's and DELLA's chunks, the Philox draws), introsort_replay.py
(TIES' magnitude selection), bf16_mix.py (TIES' bfloat16 mix) and weighted_sum.py (linear's sum) compile their loops
the same way, and all fall back to their numpy/torch paths where numba cannot be imported (a platform without a
wheel): one place says whether it can and how, and holds the helpers they share (torch's sign, the consensus codes,
bfloat16's widening and rounding, and the bit-level intrinsics, which exist only with numba: the loops that call
them are never called without it).

And one place for when they are used: a first compile takes 2-20 s a module (bench/first_run.py), far longer than
a small merge, so no merge waits for it. Each module's loops form a KernelGroup that compiles in a background
thread and is used only once ready; until then the module's numpy/torch path, which gives the same bytes, runs.
numba's on-disk cache (cache=True) makes every later process's "compile" a ~0.1-0.4 s load.

numba itself is imported by the first group that starts, not with these modules (Deferred): every command imports
them with the method registry, and most never compile anything.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..runtime import process_tuning

AVAILABLE = importlib.util.find_spec("numba") is not None
"""Whether numba is installed (a dependency; the fallbacks are exercised by the tests through each module's switch).
Asked of the import system, not by importing it: numba's import costs ~0.16 s warm, ~0.5 s cold, and is done
only when a kernel group starts (see Deferred). An install where the import then fails leaves every group
unready, so the uncompiled paths run."""

WAIT_ENV = "MERGESMITH_KERNELS"
"""Set to `wait` to have the first use of a kernel group wait for its compile instead of taking the uncompiled path:
the test suite does (tests/conftest.py), so that its comparisons of the two paths run the compiled one, and so that
no compile outlives a test (numba's compiler swaps the `warnings` module's state while it runs)."""


def waits() -> bool:
    """Whether a use of a group that is not ready yet waits for its compile (MERGESMITH_KERNELS=wait)."""
    return os.environ.get(WAIT_ENV, "") == "wait"


START_ENTRIES = 1 << 20
"""Tensors of fewer entries do not start a compile: the compiled loops save ~10-30 ns an entry (bench/README.md,
profile_compiled.py), while loading a group from numba's cache costs ~0.3-0.4 s of a core and compiling it seconds,
both competing with the merge for the GIL. A merge of only small tensors (the quick start's tiny models: 33 K entries
at most) ran ~2 s slower with the groups loading beside it (`python bench/first_run.py`); a 0.25b model's matrices
have 1-30 M entries each."""


class KernelGroup:
    """A module's compiled loops, compiled together in the background and used only once ready.

    Why: a merge must never sit waiting for a compile (13-34 s for TIES' loops on a fresh install, on a model
    that merges in a second). `ready()` answers at once; the first question about a large tensor (or the
    executor, for a merge that has one) starts the compile on a thread of its own (numba's compiler lock serialises
    groups), so the caller takes its uncompiled path meanwhile and the compiled one once it is done. A compile
    that fails leaves the group unready for good: the uncompiled path is always correct."""

    def __init__(self, name: str, compile_all: Callable[[], None]) -> None:
        self.name = name
        self._compile_all = compile_all
        self._done = threading.Event()
        self._ready = False
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._wait_for_load = False
        self.error: BaseException | None = None

    def wait_for_load(self) -> bool:
        """Have the uses of this group wait for it to get ready (up to LOAD_WAIT_SECONDS, once) instead of taking
        the uncompiled path, where numba's on-disk cache holds its loops (cached: a sub-second load, not a
        compile of seconds); whether they will. For a merge with enough work for the group (the executor decides:
        LOAD_WAIT_ENTRIES), where running the uncompiled path meanwhile costs more than the wait: the uncompiled
        workers hold the GIL the load needs, and do a fraction of the work. Measured on the 1b bench merges, cold,
        six alternating pairs against the code before (bench/README.md, ninth session of issue 33): ties 12.7-14.7 s
        (median 13.8) against 13.7-15.5 s (14.5); dare_ties 8.2-11.5 s (10.4) against 9.3-11.1 s (10.2), no gain:
        its group is ready 0.3-0.45 s after the first chunk asks, and the uncompiled chunks cost little more."""
        if not AVAILABLE or self._ready:
            return self._ready
        self._wait_for_load = self.cached()
        return self._wait_for_load

    def cached(self) -> bool:
        """Whether numba's on-disk cache holds loops of this group for their current source, so that getting ready
        is a sub-second load rather than a compile (`plan` adds a compile's cost to its estimate otherwise; a large
        merge waits for the load: wait_for_load). Read from the file system, without importing numba: every loop's
        cache index is there and newer than its source (_cache_index_current). An index can still lack this CPU's
        compiled variant (a cache shared between machines): a wait for it is then cut at LOAD_WAIT_SECONDS."""
        if not AVAILABLE or self._ready:
            return True
        loops = loops_of(self._compile_all.__module__)
        return bool(loops) and all(_cache_index_current(loop.function) for loop in loops)

    def start(self) -> None:
        """Begin compiling (or loading from numba's cache) in a daemon thread, once; nothing where numba is
        missing. Daemon: a process that ends before the compile does is not held up (what numba finished is
        cached already, function by function, and the next process carries on from there)."""
        if not AVAILABLE:
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"compile-{self.name}", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        try:
            self._compile_all()
            self._ready = True
        except Exception as error:  # noqa: BLE001 - the uncompiled path stays in use; kept for tests and -v
            self.error = error
        finally:
            self._done.set()

    def ready(self, entries: int) -> bool:
        """Whether the compiled loops may be called now for a tensor of `entries` entries. Never waits (unless
        MERGESMITH_KERNELS=wait): when they are not ready, starts their compile (for a tensor of START_ENTRIES or
        more) and answers False."""
        if self._ready:
            return True
        if not AVAILABLE or (entries < START_ENTRIES and not waits()):
            return False
        self.start()
        if waits():
            self._done.wait()
        elif self._wait_for_load:
            if not self._done.wait(LOAD_WAIT_SECONDS):
                self._wait_for_load = False  # a compile after all: the uncompiled path from now on
        return self._ready

    def wait(self) -> bool:
        """Compile now if need be and wait for it (tests, benches, and the executor under MERGESMITH_KERNELS=wait);
        whether the group is ready."""
        self.start()
        if self._thread is not None:
            self._done.wait()
        return self._ready


LOAD_WAIT_SECONDS = 3.0
"""The longest a use of a group that waits for its load (KernelGroup.wait_for_load) waits: a load from numba's
cache took 0.3-1.1 s on the 1b bench merges (numba's import included); past this it is a compile, not waited for."""

LOAD_WAIT_ENTRIES = 1 << 28
"""Entries (of the tensors a group's loops would merge) from which a merge waits for the group's load rather than
starting uncompiled: 268 M, a quarter of a 1 B-parameter model, whose compiled merge lasts seconds beside a load of
~0.5-1 s; a smaller merge would finish (or nearly) on the uncompiled path before the load."""


def _cache_index_current(function: Callable[..., Any]) -> bool:
    """Whether numba's cache index file of `function` (cache=True) exists, in one of the places numba's locators
    put it (beside the source in __pycache__, under NUMBA_CACHE_DIR, or in the user's cache), and is at least as new
    as the source file (numba invalidates an index older than its source). numba's own naming: the module file's
    stem, the qualified name, the first line, the Python version."""
    try:
        code = function.__code__
        source = Path(os.path.abspath(code.co_filename))
        name = (f"{source.stem}.{function.__qualname__}-{code.co_firstlineno}"
                f".py{sys.version_info[0]}{sys.version_info[1]}{getattr(sys, 'abiflags', '')}.nbi")
        name = name.replace("<", "").replace(">", "")
        subpath = f"{source.parent.name}_{hashlib.sha1(str(source.parent).encode()).hexdigest()}"
        user_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "numba"
        places = [source.parent / "__pycache__", user_cache / subpath]
        if os.environ.get("NUMBA_CACHE_DIR"):
            places.insert(0, Path(os.environ["NUMBA_CACHE_DIR"]) / subpath)
        newest_source = source.stat().st_mtime
        return any((place / name).is_file() and (place / name).stat().st_mtime >= newest_source for place in places)
    except (OSError, AttributeError, ValueError):
        return False


CONSENSUS_CODES = {None: 0, "sum": 1, "count": 2}
"""How the compiled mixes are told the sign consensus (none, `sum`, `count`)."""


_LOAD_LOCK = threading.RLock()
_numba: Any = None  # the numba module once loaded
_extensions: list[Callable[[], None]] = []  # typing hooks (overloads, intrinsics) waiting for numba
_deferred: list[Deferred] = []


class Deferred:
    """A compiled loop made when first needed, so that numba is imported only by a kernel group's compile (in its
    background thread), never on the way to a merge's first read.

    Why not `njit` at import: the kernel modules are imported with the method registry by every command, and
    `import numba` took 0.16 s warm and 0.5 s cold of the main thread before the input feed starts (bench/README.md,
    "Start-up"), and every command on small models, which never starts a compile, paid it for nothing.

    Called from Python it makes the real dispatcher (importing numba) and calls it. Referenced as a global by
    another compiled loop (or by an overload's implementation), numba types it as the real one: `load` registers
    a typeof for this class that makes and types the real dispatcher, so calls between loops compile as direct
    calls, as before."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function  # the Python source of the loop
        self._real: Any = None
        self.__name__ = function.__name__
        self.__doc__ = function.__doc__
        self.__module__ = function.__module__
        self.__wrapped__ = function
        _deferred.append(self)

    def real(self) -> Any:
        """The numba dispatcher, made on first use; numba is imported then."""
        if self._real is None:
            with _LOAD_LOCK:
                if self._real is None:
                    self._real = _jit(self.function)
        return self._real

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.real()(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<compiled {self.__module__}.{self.__name__} ({'made' if self._real is not None else 'deferred'})>"


def loaded() -> bool:
    """Whether numba has been imported by this package's kernels (tests: no merge start-up imports it)."""
    return _numba is not None


def load() -> Any:
    """Import numba (once), teach it the Deferred objects, and run the typing hooks the kernel modules registered
    (numba_extension). Raises ImportError where numba cannot be imported: a group's compile then fails and
    leaves it unready."""
    global _numba
    with _LOAD_LOCK:
        if _numba is None:
            with process_tuning.numba_without_blas():
                import numba
                import numba.np.arraymath  # noqa: F401 - where numba asks for scipy's BLAS, inside the block
            from numba.extending import typeof_impl

            @typeof_impl.register(Deferred)
            def _typeof_deferred(value: Deferred, context: Any) -> Any:
                return numba.typeof(value.real(), context.purpose)

            _numba = numba
            while _extensions:
                _extensions.pop(0)()
        return _numba


def numba_extension(register: Callable[[], None]) -> Callable[[], None]:
    """Run `register` (it defines numba overloads with numba imported inside it) once numba is loaded: now if it
    is, else with `load`."""
    with _LOAD_LOCK:
        if _numba is None:
            _extensions.append(register)
        else:
            register()
    return register


def _jit(function: Callable[..., Any]) -> Any:
    njit = load().njit
    try:
        # numba's cache goes beside this file (`__pycache__`) where that is writable, else to the user's cache
        # (NUMBA_CACHE_DIR, or ~/.cache/numba under XDG_CACHE_HOME's rule)
        return njit(nogil=True, cache=True, error_model="numpy")(function)
    except RuntimeError:  # no writable place at all (read-only install and home): compile in every process
        return njit(nogil=True, error_model="numpy")(function)


def compiled(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` compiled to machine code that runs without the GIL, cached on disk (the first use in a fresh
    install compiles for seconds, later processes load it in ~0.1 s: see KernelGroup), with numpy's float
    semantics (a division by zero gives inf or nan, not an exception); `function` itself where numba is missing.
    The dispatcher is made on first use (Deferred)."""
    if not AVAILABLE:
        return function
    return Deferred(function)


def loops_of(module_name: str) -> list[Deferred]:
    """The compiled loops a module defines (KernelGroup.cached reads their cache index)."""
    return [d for d in _deferred if d.__module__ == module_name]


@compiled
def widen_bf16(bits):
    """The float32 of bfloat16 bits (a uint16): exact, the bits shifted into the high half."""
    return float32_from_bits(np.uint32(bits) << np.uint32(16))


@compiled
def round_bf16(value):
    """value rounded to the nearest bfloat16, ties to even (torch's conversion), back as float32; nan stays nan.
    Written without a branch so the loops that call it vectorise."""
    bits = bits_from_float32(value)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return value if value != value else float32_from_bits(rounded)


@compiled
def narrow_bf16(value):
    """The bf16 bits of a float32 that is already a bfloat16 value (as round_bf16 leaves it)."""
    return np.uint16(bits_from_float32(value) >> np.uint32(16))


@compiled
def sign(x):
    """torch.sign of a float32: (0 < x) - (x < 0), so +0 for zeros and nan; without a branch, so that loops
    calling it vectorise."""
    return np.float32(x > 0) - np.float32(x < 0)


float32_from_bits: Any = None
bits_from_float32: Any = None
fused_multiply_add: Any = None


@numba_extension
def _define_intrinsics() -> None:
    """The bit-level intrinsics the loops call (a few LLVM instructions each), defined once numba is loaded: an
    intrinsic is a numba object, so it cannot exist before the import. A module whose loops call one takes it
    with a numba_extension of its own (registered after this one, so run after it)."""
    global float32_from_bits, bits_from_float32, fused_multiply_add
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def float32_from_bits(typingctx, bits):
        """The float32 whose IEEE bits are the uint32 `bits` (a bitcast: no instruction)."""

        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.FloatType())

        return types.float32(types.uint32), codegen

    @intrinsic
    def bits_from_float32(typingctx, value):
        """The IEEE bits of the float32 `value`, as a uint32."""

        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.IntType(32))

        return types.uint32(types.float32), codegen

    @intrinsic
    def fused_multiply_add(typingctx, a, b, c):
        """a * b + c in float32 with one rounding (llvm.fma: one instruction on a CPU with FMA, as torch's AVX2
        and AVX-512 kernels use for addcmul)."""

        def codegen(context, builder, sig, args):
            return builder.fma(*args)

        return types.float32(types.float32, types.float32, types.float32), codegen
