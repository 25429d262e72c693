"""Running a plan into an output directory, the protocol every command shares: plan, execute, finish, resume.

Output directory protocol, which makes merges crash-consistent:
The state (journal, partial shards, lock) lives in `<out>/.cache/huggingface/mergesmith/` (io/journal.py
says why there: uploads skip it); below, `<state>`.
0. one run at a time holds `<state>/lock` (flock: released by the kernel even on SIGKILL);
1. the journal (plan fingerprint) is written first, and any config.json/index from an earlier run
   is removed (before any damaged shard), so a directory is never mistaken for complete while
   shards change;
2. a plan's data steps (engine/extensions.py: regmean's Gram collection) write their inputs into `<state>`, each
   file atomically, so a rerun reuses them; then shards are written under `<state>/partial/`, fsync'ed, renamed
   into place, journaled;
3. tokenizer files, model card and the config (`mergekit_config.yml`, as mergekit names it) are written;
4. the index and finally `config.json` are written atomically: a directory that has `config.json`
   has all of its shards (then the data steps' inputs are removed).

A raw merge (`merge-raw`: bare state dicts, no architecture) has no `config.json`; its last model
file is the index when sharded, else its single shard (whole by construction: fsync'ed, then renamed
into place). Either way the journal's `complete` flag is set only after that file, and it is what
a rerun trusts.

Resuming an incomplete merge checksums every finished shard before reusing it (a shard may be torn).
A rerun of a complete merge reads no shard bytes when every shard still has the size and mtime the
journal recorded on completion; a shard that was touched or changed since (other mtime or size) makes
it checksum every shard, as does `verify=True`. (A change that keeps both size and mtime, such as an
in-place edit followed by `touch -r`, goes unseen without `verify`.)
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..config import MergeConfiguration, load_config
from ..errors import MergeInterrupted, MergesmithError, OutputError
from ..io import hub, safe_fs
from ..io._test_hooks import kill_point
from ..io.checkpoint import Checkpoint
from ..io.journal import (
    LEGACY_STATE_DIR,
    LOCK_NAME,
    STATE_PARTS,
    Journal,
    adopt_legacy_state,
    ensure_writable_dir,
    foreign_entries,
    partial_path,
    refuse_non_directory,
)
from ..io.references import open_checkpoint
from ..io.safetensors_writer import file_checksum, write_file_atomic
from ..methods import require_method
from ..runtime.devices import start_cuda_init
from ..sizes import human_size
from .downloads import check_download_space, pending_downloads
from .execution.local_executor import ExecutionSettings, Executor, LocalExecutor, ProgressEvent
from .plan import CONFIG_NAME, MOE_CONFIG_NAME, OWN_CONFIG_NAME, Plan
from .planning.merge_planner import Planner
from .planning.shared import MergeOptions
from .report import over_budget_warning
from .time_estimate import long_poles

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks, so concurrent runs go undetected
    fcntl = None  # type: ignore[assignment]

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAMES = (CONFIG_NAME, MOE_CONFIG_NAME, OWN_CONFIG_NAME)
SMALL_FILES_MARGIN = 16 << 20


@dataclass
class MergeResult:
    """What a run into a directory did. A rerun after an interruption reuses what earlier runs made durable:
    whole shards (`shards_reused`) and, inside unfinished shards, every journaled tensor whose checksum still
    matches; `tensors_reused` counts both (all of them when `already_complete`). `resume_line()` is how the
    command line and the API report it."""

    out_dir: Path
    plan: Plan
    shards_reused: int
    already_complete: bool
    seconds: float
    warnings: list[str] = field(default_factory=list)  # found while merging: NaN/inf in inputs or outputs
    tensors_reused: int = 0
    shards_discarded: int = 0  # finished shards that failed their size or checksum check and were written again

    @property
    def resumed(self) -> bool:
        """Whether this run continued an earlier one (reused any tensor) rather than finding it complete."""
        return not self.already_complete and (self.tensors_reused > 0 or self.shards_discarded > 0)

    def resume_line(self) -> str | None:
        """`resumed: 8 of 75 tensors already written (1 of 3 shards whole)`, or None when nothing was resumed."""
        if not self.resumed:
            return None
        total = len(self.plan.recipes)
        line = f"resumed: {self.tensors_reused} of {total} tensors already written"
        if self.shards_reused:
            line += f" ({self.shards_reused} of {len(self.plan.shards)} shards whole)"
        if self.shards_discarded:
            s = "s" if self.shards_discarded != 1 else ""
            line += f"; {self.shards_discarded} missing or damaged shard{s} written again"
        return line


def as_config(config: str | Path | MergeConfiguration, strict: bool = False) -> tuple[MergeConfiguration, str]:
    if isinstance(config, MergeConfiguration):
        return config, "config"
    return load_config(config, strict=strict), str(config)


def open_checkpoints(config: MergeConfiguration, options: MergeOptions | None = None) -> dict[str, Checkpoint]:
    """Open (and validate the headers of) every model the config names (LoRA inputs as `options` say)."""
    if options is None:
        return {ref: open_checkpoint(ref) for ref in config.referenced_models()}
    return {ref: options.open_input(ref) for ref in config.referenced_models()}


def build_plan(
    config: str | Path | MergeConfiguration,
    options: MergeOptions | None = None,
    out_dir: str | Path | None = None,
    source: str | None = None,
) -> tuple[Plan, dict[str, Checkpoint]]:
    """Plan a merge from headers alone. For randomised methods without a seed, reuse the seed an
    interrupted run in `out_dir` recorded (so it can resume), or draw a new one. `source` names the
    config in messages (default: its path, or "config" for a parsed one)."""
    options = options or MergeOptions()
    cfg, default_source = as_config(config, options.strict)
    source = source or default_source
    choose_random_seed(cfg, source, options, out_dir)
    checkpoints = open_checkpoints(cfg, options)
    planner_cls: type[Planner] = Planner
    if cfg.modules:
        from .planning.module_planner import (
            ModulePlanner,  # mergekit's `modules:` form: each module merged by its own definition
        )

        planner_cls = ModulePlanner
    return planner_cls(cfg, checkpoints, options, source).build(), checkpoints


def choose_random_seed(cfg: MergeConfiguration, source: str, options: MergeOptions, out_dir: str | Path | None) -> None:
    """Set `options.random_seed` for a randomised method without one (see `reuse_or_draw_seed`)."""
    if require_method(cfg.merge_method, source).randomized:
        reuse_or_draw_seed(options, out_dir)


def reuse_or_draw_seed(options: MergeOptions, out_dir: str | Path | None) -> None:
    """Without a seed in `options`: the seed an interrupted run in `out_dir` recorded (so the rerun plans the
    same bytes and resumes), or a new one. Every planner whose output draws random numbers asks this."""
    if options.random_seed is None:
        previous = Journal.load(Path(out_dir)) if out_dir is not None else None
        if previous and previous.random_seed is not None:
            options.random_seed = previous.random_seed
        else:
            options.random_seed = secrets.randbelow(2**31)
            options.seed_drawn = True


def completion_marker(plan: Plan) -> str:
    """The file written last (before the journal says `complete`): config.json, or for a raw merge
    the index when sharded, else the single shard."""
    if not plan.options.get("raw"):
        return "config.json"
    return INDEX_NAME if len(plan.shards) > 1 else plan.shards[0].filename


def _owned_outputs(out_dir: Path) -> list[Path]:
    """Files a merge writes (and so may remove with --overwrite); other files are left alone."""
    names = {"config.json", INDEX_NAME, "README.md", "generation_config.json", *CONFIG_NAMES}
    from ..io.model_files import TOKENIZER_FILES

    names.update(TOKENIZER_FILES)
    # config.json and the index go first: a directory that still has them must still have every shard.
    found = [out_dir / n for n in ("config.json", INDEX_NAME) if os.path.lexists(out_dir / n)]
    found += [out_dir / n for n in sorted(names - {"config.json", INDEX_NAME}) if os.path.lexists(out_dir / n)]
    found += sorted(out_dir.glob("model*.safetensors"))
    return found


def _remove(path: Path) -> None:
    """Remove one output file (a crash-test kill point: what is left must never look complete). A link
    is removed itself, never followed."""
    if os.path.lexists(path):
        path.unlink()
        kill_point("unlink", path.name)


def _refuse_input_directory(out_dir: Path, checkpoints: dict[str, Checkpoint]) -> None:
    """Refuse to write into a directory that holds an input model's files: `--overwrite` would delete
    that model (its config.json and model*.safetensors are exactly the names a merge replaces); and
    into a directory inside a model directory (one with a config.json), which would nest the merge
    in that model."""
    target = out_dir.resolve()
    for ckpt in checkpoints.values():
        model_dir = ckpt.root.resolve()
        if model_dir == target or any(f.resolve().parent == target for f in ckpt.files):
            raise OutputError(
                f"{out_dir}: is the directory of input model {ckpt.ref!r}; write the merge to another directory"
            )
        if getattr(ckpt, "config", None) is not None and model_dir in target.parents:
            raise OutputError(
                f"{out_dir}: is inside the directory of input model {ckpt.ref!r}; "
                "write the merge to a directory outside it"
            )


@contextmanager
def _exclusive(out_dir: Path) -> Iterator[None]:
    """Hold `<state>/lock` while writing into `out_dir` (and adopt an older version's `.mergesmith/` under it).

    A second run into the same directory (another terminal, a scheduler's retry) would reopen the
    same partial files by name, truncating what the first already wrote and journaled, and rename
    files from under it; so it is refused. The kernel drops an flock when its holder dies, SIGKILL
    included, so a crash never leaves the directory locked.
    """
    ensure_writable_dir(out_dir)
    if fcntl is None:
        adopt_legacy_state(out_dir)
        yield
        return
    try:
        with safe_fs.opened_dir(out_dir, STATE_PARTS) as state:
            fd = safe_fs.open_lock_file(state, LOCK_NAME)
    except OSError as exc:
        if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        yield  # nobody can write here, so nobody can race us; the first write says what is wrong
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputError(
                f"{out_dir}: another mergesmith process is writing to this directory; wait for it or stop it first"
            ) from None
        adopt_legacy_state(out_dir)
        yield
    finally:
        os.close(fd)


def _prepare_out_dir(out_dir: Path, fingerprint: str, overwrite: bool) -> Journal:
    """Validate the output directory and return the journal to continue (or a fresh one)."""
    ensure_writable_dir(out_dir)
    journal = Journal.load(out_dir)
    others = foreign_entries(out_dir)
    if journal is not None and journal.fingerprint == fingerprint and not overwrite:
        return journal
    if overwrite:
        for path in _owned_outputs(out_dir):
            _remove(path)
        if (out_dir / LEGACY_STATE_DIR).is_symlink():  # a link where older versions kept their state: unlinked
            _remove(out_dir / LEGACY_STATE_DIR)
        with safe_fs.opened_dir(out_dir, STATE_PARTS) as state:  # never through a link (safe_fs)
            for name in os.listdir(state):  # all but the lock this run holds; links removed, not followed
                if name != LOCK_NAME:
                    safe_fs.remove_tree(state, name)
    elif journal is not None:
        raise OutputError(f"{out_dir}: holds a merge with a different config or inputs; use --overwrite to replace it")
    elif others:
        raise OutputError(f"{out_dir}: directory is not empty; use --overwrite to replace its model files")
    return Journal(out_dir, fingerprint)


def _untouched_since_complete(out_dir: Path, plan: Plan, journal: Journal) -> bool:
    """A complete merge whose shards all still have the size and mtime recorded when it completed.

    Such a rerun is trusted without reading the shards (a finished 140 GB merge would otherwise be
    re-read in full just to say "nothing to do"). A shard that was touched, rewritten, truncated or
    replaced since has another mtime or size, and the rerun then verifies every shard by checksum
    (as it always does when resuming an incomplete merge, where a shard may be torn). A journal from
    before mtimes were recorded is verified in full too. `verify=True` forces the full check.
    """
    if not journal.complete or not (out_dir / completion_marker(plan)).is_file():
        return False
    if set(journal.finished) != {s.filename for s in plan.shards}:
        return False
    for name, record in journal.finished.items():
        try:
            st = (out_dir / name).lstat()  # a link in a shard's place is not that shard
        except OSError:
            return False
        if not stat.S_ISREG(st.st_mode) or st.st_size != record.get("size") or st.st_mtime_ns != record.get("mtime_ns"):
            return False
    return True


def _record_mtimes(out_dir: Path, journal: Journal) -> bool:
    """Store each finished shard's mtime in the journal (what `_untouched_since_complete` trusts);
    True when any changed."""
    changed = False
    for name, record in journal.finished.items():
        mtime = (out_dir / name).lstat().st_mtime_ns
        if record.get("mtime_ns") != mtime:
            record["mtime_ns"] = mtime
            changed = True
    return changed


def _verify_finished(out_dir: Path, plan: Plan, journal: Journal, stop: threading.Event | None = None) -> list[Path]:
    """Keep journaled shards whose file still has the recorded size and checksum; forget the rest.

    Returns the shard files to delete. The caller deletes them only after removing config.json and
    the index, so that no moment (and no kill) leaves a directory that looks complete but lacks a shard.
    Checksumming a large merge reads every byte it wrote (minutes for hundreds of GB), so a Ctrl-C
    (`stop`) is honoured between shards; nothing has been changed on disk at that point.
    """
    planned = {s.filename for s in plan.shards}
    bad: list[Path] = []
    for name, record in list(journal.finished.items()):
        if stop is not None and stop.is_set():
            raise MergeInterrupted(
                "interrupted while verifying the finished shards; nothing was changed, run the same command "
                "again to resume"
            )
        path = out_dir / name
        try:
            st = path.lstat()  # a link in a shard's place is not that shard: removed and rewritten
        except OSError:
            st = None
        ok = name in planned and st is not None and stat.S_ISREG(st.st_mode) and st.st_size == record.get("size")
        if ok:
            try:
                ok = file_checksum(path) == record.get("checksum")
            except (MergesmithError, OSError, ValueError):
                ok = False
        if not ok:
            journal.finished.pop(name)
            bad.append(path)
    return bad



def _prepare_inputs(
    out_dir: Path, plan: Plan, checkpoints: dict[str, Checkpoint], stop: threading.Event | None
) -> dict[str, Checkpoint]:
    """Run the data steps the plan names (`prepare`: e.g. regmean's Gram collection) into the state directory;
    the checkpoints with the inputs they made added. Each step journals its own work, so a rerun reuses it."""
    names = plan.options.get("prepare") or []
    if not names:
        return checkpoints
    from .extensions import data_step

    made = dict(checkpoints)
    for name in names:
        made.update(data_step(name).prepare(plan, checkpoints, out_dir, stop))
    return made


def _finish_data_steps(out_dir: Path, plan: Plan) -> None:
    """Let each data step drop what it made (a complete merge never reads it again: Grams can be large)."""
    from .extensions import data_step

    for name in plan.options.get("prepare") or []:
        data_step(name).finish(out_dir)


def _check_space(out_dir: Path, plan: Plan, journal: Journal, force: bool) -> None:
    # what data steps write into the state before the merge (regmean's Grams; counted whole even when resuming)
    needed = SMALL_FILES_MARGIN + int(plan.options.get("prepare_bytes") or 0)
    for shard in plan.shards:
        if shard.filename in journal.finished:
            continue
        partial = partial_path(out_dir, shard.filename)
        try:  # an interrupted run's reservation (a link there is removed, so it reserves nothing)
            st = partial.lstat()
            reserved = st.st_blocks * 512 if stat.S_ISREG(st.st_mode) else 0
        except OSError:
            reserved = 0
        needed += max(0, shard.data_bytes - reserved)
    free = shutil.disk_usage(out_dir).free
    if free < needed and not force:
        raise OutputError(
            f"{out_dir}: not enough free space: the merge needs {human_size(needed, 2)}, the filesystem has "
            f"{human_size(free, 2)} free (use --force to try anyway)"
        )


def _write_small_files(out_dir: Path, plan: Plan) -> None:
    for src, name in plan.files_to_copy:
        write_file_atomic(out_dir / name, Path(src).read_bytes())
    write_file_atomic(out_dir / plan.config_name, plan.config_yaml.encode())
    if plan.model_card is not None:
        write_file_atomic(out_dir / "README.md", plan.model_card.encode())


def _write_index_and_config(out_dir: Path, plan: Plan) -> None:
    import json

    if len(plan.shards) > 1:
        weight_map = {name: s.filename for s in plan.shards for r in s.recipes for name, _d, _s in r.stored()}
        index = {"metadata": {"total_size": plan.total_size}, "weight_map": dict(sorted(weight_map.items()))}
        write_file_atomic(out_dir / INDEX_NAME, (json.dumps(index, indent=2) + "\n").encode())
    if not plan.options.get("raw"):
        from .planning.quantization import written_config

        config = written_config(plan.output_config, any(r.quantize for r in plan.recipes))
        write_file_atomic(out_dir / "config.json", (json.dumps(config, indent=2) + "\n").encode())


@dataclass(frozen=True)
class RunControls:
    """How a run into a directory is driven, the same for every command that writes a model: whether it may
    replace a different output (`overwrite`) or start on a disk that looks too small (`force`), the plan and
    progress callbacks, the event that stops it at a resumable point, and whether a complete output is
    checksummed (`verify`). The run functions (`run_merge`, `execute_plan`, the features' `run_*`) take it as
    one `controls` argument; frozen, so the default instance is safe to share."""

    overwrite: bool = False
    force: bool = False
    on_plan: Callable[[Plan], None] | None = None
    on_progress: Callable[[ProgressEvent], None] | None = None
    stop: threading.Event | None = None
    verify: bool = False


def run_planned(
    plan_into: Callable[[MergeOptions, Path], tuple[Plan, dict[str, Any]]],
    out_dir: str | Path,
    options: MergeOptions | None,
    controls: RunControls,
) -> MergeResult:
    """The sequence every command that writes a model runs: start the clock, plan (`plan_into`, given the
    options and the output directory, returns the plan and its opened inputs), write the plan with
    `execute_plan`. Merge, raw merge, MoE and tokensurgeon differ only in their `plan_into`."""
    started = time.monotonic()
    out = Path(out_dir)
    options = options or MergeOptions()
    if options.executor != "ray":  # Ray workers hold the GPUs, not this driver
        start_cuda_init(options.device)
    with hub.forcing(controls.force):  # hub models downloaded while planning: --force covers their disk check
        plan, inputs = plan_into(options, out)
    return execute_plan(plan, inputs, out, options, controls=controls, started=started)


def run_merge(
    config: str | Path | MergeConfiguration,
    out_dir: str | Path,
    options: MergeOptions | None = None,
    *,
    controls: RunControls = RunControls(),
) -> MergeResult:
    """Merge into `out_dir`; rerunning after an interruption resumes where it stopped (`controls.verify`: see
    `execute_plan`)."""

    def plan_into(options: MergeOptions, out: Path) -> tuple[Plan, dict[str, Checkpoint]]:
        refuse_non_directory(out)
        cfg, source = as_config(config, options.strict)
        check_download_space(pending_downloads(cfg.referenced_models()), out, controls.force)
        plan, checkpoints = build_plan(cfg, options, out, source)
        over_budget = over_budget_warning(plan, options.max_memory)  # as `plan` says it, at the merge's start
        if over_budget is not None and over_budget not in plan.warnings:
            plan.warnings.append(over_budget)
        return plan, checkpoints

    return run_planned(plan_into, out_dir, options, controls)


def execute_plan(
    plan: Plan,
    checkpoints: dict[str, Checkpoint],
    out_dir: str | Path,
    options: MergeOptions,
    *,
    controls: RunControls = RunControls(),
    started: float | None = None,
) -> MergeResult:
    """Write any plan (a merge, an MoE assembly, ...) into `out_dir` with the journaled protocol.

    Every planner ends here, so resume, the disk check, progress and crash-consistency come for free.
    A rerun of a complete merge trusts shards whose size and mtime are unchanged unless `controls.verify`,
    which re-reads and checksums every shard (see `_untouched_since_complete`).
    """
    started = time.monotonic() if started is None else started
    out = Path(out_dir)
    refuse_non_directory(out)
    _refuse_input_directory(out, checkpoints)
    _check_device_budget(plan, options)
    if controls.on_plan is not None:
        controls.on_plan(plan)
    fingerprint = plan.fingerprint()
    try:
        with _exclusive(out):
            journal = _prepare_out_dir(out, fingerprint, controls.overwrite)
            journal.random_seed = plan.random_seed
            return _write_plan(
                out, plan, checkpoints, options, journal, controls.force, controls.on_progress, controls.stop,
                started, controls.verify,
            )
    except OSError as exc:  # a full or read-only disk, a quota: the user's environment, not a bug
        if exc.filename:
            raise OutputError(f"{exc.filename}: {exc.strerror or exc}") from None
        raise OutputError(f"{out}: write failed ({exc.strerror or exc})") from None


def _check_device_budget(plan: Plan, options: MergeOptions) -> None:
    """On CUDA (local executor), refuse before anything is written a tensor whose device working set alone exceeds
    the device budget (--max-gpu-memory, else the free memory less a margin): planning/device_memory.py."""
    if not options.device.startswith("cuda") or options.executor == "ray":
        return
    from ..runtime.device_memory import device_limit
    from .planning.device_memory import check_device_budget

    check_device_budget(plan.recipes, plan.compute_dtype, device_limit(options.device, options.max_gpu_memory))


def _write_plan(
    out: Path,
    plan: Plan,
    checkpoints: dict[str, Checkpoint],
    options: MergeOptions,
    journal: Journal,
    force: bool,
    on_progress: Callable[[ProgressEvent], None] | None,
    stop: threading.Event | None,
    started: float,
    verify: bool = False,
) -> MergeResult:
    """Steps 1-4 of the output-directory protocol (see the module docstring) into a prepared `out`."""
    everything = len(plan.recipes)
    if not verify and _untouched_since_complete(out, plan, journal):
        return MergeResult(out, plan, len(journal.finished), True, time.monotonic() - started, [], everything)
    bad = _verify_finished(out, plan, journal, stop)
    reused = len(journal.finished)
    if journal.complete and not bad and reused == len(plan.shards) and (out / completion_marker(plan)).is_file():
        try:  # every shard checked out: trust their (new) mtimes next time; a read-only disk just re-verifies
            if _record_mtimes(out, journal):
                journal.save()
        except OSError:
            pass
        return MergeResult(out, plan, reused, True, time.monotonic() - started, [], everything)
    journal.complete = False
    for stale in (out / "config.json", out / INDEX_NAME, *bad):
        _remove(stale)
    journal.save()
    _check_space(out, plan, journal, force)
    executor_cls: type[Executor] = LocalExecutor
    if options.executor == "ray":
        from .execution.ray_executor import RayExecutor  # Ray is optional: imported only when asked for

        executor_cls = RayExecutor
    checkpoints = _prepare_inputs(out, plan, checkpoints, stop)
    settings = replace(ExecutionSettings.of(options), start_first=long_poles(plan.recipes, options.threads))
    executor = executor_cls(plan, checkpoints, out, journal, settings, on_progress=on_progress, stop=stop)
    executor.run()
    monitor = getattr(executor, "monitor", None)
    warnings = monitor.warnings() if monitor is not None else []
    _write_small_files(out, plan)
    _write_index_and_config(out, plan)
    _record_mtimes(out, journal)
    journal.complete = True
    journal.save()
    _finish_data_steps(out, plan)
    seconds = time.monotonic() - started
    return MergeResult(out, plan, reused, False, seconds, warnings, executor.resumed_tensors, len(bad))
