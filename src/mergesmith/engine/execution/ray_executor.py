"""The Ray executor: one Ray task per output shard, on a filesystem every node shares.

Why whole shards: a shard is the unit the output protocol already journals, so a task needs nothing
from the driver but the plan (plain data, put once in the object store) and the absolute paths of
its inputs. Each task opens those inputs itself, checks they are the very files the driver planned
from (size, mtime and header hash, as in the plan's fingerprint: a node that mounts something else
fails loudly instead of writing a wrong shard), and runs `LocalExecutor` on its one shard, which
writes the shard under the state directory's `partial/`, fsyncs it and renames it into place. The driver owns
the journal: it records each shard as its task returns, so an interrupted Ray merge resumes exactly
like a local one (with either executor), and `engine.run.execute_plan` writes the index and config.json
after the last shard, as always.

A task whose worker process dies (killed, out of memory, node lost) is retried by Ray up to
`max_retries` times; the retry rewrites the shard from scratch (or from the journaled partial state
the driver handed it). Exceptions raised by the merge itself (a bad input, a full disk) are not
retried: they reach the caller as the original one-line error.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ...errors import CheckpointError, ConfigError, MergeInterrupted, MergesmithError, OutputError
from ...io.checkpoint import Checkpoint, resolve_model_path
from ...io.journal import Journal
from ...io.references import open_checkpoint
from ..plan import Plan, ShardPlan
from .local_executor import ExecutionSettings, Executor, LocalExecutor, ProgressEvent

try:
    import ray
    from ray import exceptions as ray_exceptions
except ImportError:  # pragma: no cover - exercised only where Ray is absent
    raise ConfigError("`--executor ray` needs Ray, which is not installed: pip install 'mergesmith[ray]'") from None

TASK_THREADS = 2  # per shard task: enough to overlap reading, merging and writing on the one CPU it reserves
MAX_RETRIES = 3
CONNECT_TIMEOUT_S = 10.0
DRAIN_TIMEOUT_S = 60.0  # how long stopped tasks get to finish their tensors in flight before being killed
# Test hook: a directory. The first shard task to write a tensor claims the marker `killed` there (naming
# its shard) and SIGKILLs its own worker, leaving a partial file behind, so a test can prove Ray retries it.
KILL_ONCE_ENV = "MERGESMITH_TEST_RAY_KILL_ONCE"


_keep_alive = 0  # nesting depth of `shared_local_ray()` blocks
_started_here = False  # a Ray this process started inside such a block, to shut down when it ends


@contextmanager
def shared_local_ray() -> Iterator[None]:
    """Within this block, a Ray that a `RayExecutor` starts stays up for the next one (a multi-stage
    run: starting a local Ray costs 15-20 s, once per stage otherwise); it is shut down when the
    block ends. Nothing is started until an executor needs Ray, so a run whose stages are all
    complete starts none. A Ray the caller initialised is left alone (as `RayExecutor` always does);
    a cluster joined at an address is only disconnected from, never stopped."""
    global _keep_alive, _started_here
    _keep_alive += 1
    try:
        yield
    finally:
        _keep_alive -= 1
        if _keep_alive == 0 and _started_here:
            _started_here = False
            ray.shutdown()


class _TaskJournal(Journal):
    """A shard task's in-memory journal: only the driver writes journal.json, from the task's result."""

    def save(self) -> None:
        return None


def _open_inputs(plan: Plan, shard: ShardPlan, paths: dict[str, str]) -> dict[str, Checkpoint]:
    """Open the inputs this shard reads and check they are the files the driver planned from."""
    checkpoints: dict[str, Checkpoint] = {}
    for ref in sorted({i.model for recipe in shard.recipes for i in recipe.inputs}):
        ckpt = open_checkpoint(paths[ref])
        ckpt.ref = ref
        expected = plan.input_identities.get(ref)
        if expected is not None and [list(x) for x in ckpt.identity()] != [list(x) for x in expected]:
            raise CheckpointError(
                f"model {ref!r}: the files at {paths[ref]} on Ray node {os.uname().nodename} differ from the ones the "
                "driver planned from (size, mtime or header); inputs must be on a filesystem every node shares"
            )
        checkpoints[ref] = ckpt
    return checkpoints


def _kill_once(marker_dir: str, shard: str) -> Callable[[ProgressEvent], None]:
    marker = Path(marker_dir) / "killed"

    def hook(event: ProgressEvent) -> None:
        if event.recipe is None or marker.exists():
            return
        try:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL)  # exactly one task in the cluster wins
        except FileExistsError:
            return
        os.write(fd, shard.encode())
        os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)

    return hook


def write_shard(
    plan: Plan,
    index: int,
    out_dir: str,
    paths: dict[str, str],
    resume: dict[str, int] | None,
    threads: int,
    max_memory: int | None,
    device: str,
    kill_once: str | None = None,
    strict: bool = False,
    max_gpu_memory: int | None = None,
) -> dict[str, Any]:
    """Body of one Ray task: write shard `index` of `plan` into `out_dir`; returns its journal record."""
    shard = plan.shards[index]
    out = Path(out_dir)
    checkpoints = _open_inputs(plan, shard, paths)
    journal = _TaskJournal(out, fingerprint=plan.fingerprint())
    if resume:
        journal.partial[shard.filename] = dict(resume)
    LocalExecutor(
        dataclasses.replace(plan, shards=[shard]),
        checkpoints,
        out,
        journal,
        # strict: NaN/inf refused in the worker; the GPU budget: the worker's device (its free memory by default)
        ExecutionSettings(threads, max_memory, device, strict, max_gpu_memory=max_gpu_memory),
        on_progress=_kill_once(kill_once, shard.filename) if kill_once else None,
    ).run()
    return journal.finished[shard.filename]


_write_shard_task = ray.remote(write_shard)


def _input_path(ckpt: Checkpoint) -> str:
    """What a worker opens for an input: the driver's resolved absolute path(s), whatever the worker's cwd
    (for `model+lora`, both parts)."""
    ref = ckpt.ref
    if "+" in ref and not Path(ref).expanduser().exists():
        from ...io.lora_adapter import split_lora_ref

        model, adapter_dir = split_lora_ref(ref)
        return f"{resolve_model_path(model).resolve()}+{adapter_dir.resolve()}"
    return str(resolve_model_path(ref).resolve())


def _check_reachable(address: str) -> None:
    """Fail in seconds on a `HOST:PORT` head address nobody listens at (Ray itself retries for minutes)."""
    host, sep, port = address.rpartition(":")
    if "://" in address or not sep or not port.isdigit():
        return  # `auto`, `ray://...`: Ray resolves these itself
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise MergesmithError(
            f"cannot reach the Ray head at {address} ({exc.strerror or exc}); is `ray start --head` running there?"
        ) from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else exc.__class__.__name__


class RayExecutor(Executor):
    """Runs every unfinished shard of a plan as a Ray task; same arguments as `LocalExecutor`.

    Joins the Ray cluster at the settings' `ray_address` (or RAY_ADDRESS, or starts a local Ray) unless Ray is already
    initialised in this process, and shuts down only what it started.
    """

    def _prepare(self) -> None:
        self.max_retries = MAX_RETRIES  # read here, when the run starts (tests lower it)
        self.out_dir = Path(self.out_dir).resolve()
        self.threads = min(self.threads, TASK_THREADS)
        self.address = self.settings.ray_address
        self._done = 0
        self._bytes = 0

    def run(self) -> None:
        pending = [(i, s) for i, s in enumerate(self.plan.shards) if s.filename not in self.journal.finished]
        self._done = self._total - sum(len(s.recipes) for _, s in pending)
        self._bytes = self.plan.total_size - sum(s.data_bytes for _, s in pending)  # a resume starts at what is done
        # plus the tensors a local run journaled inside an unfinished shard, which its task reuses once their
        # checksums match (the driver cannot see that check: the journal's word is the count reported)
        self.resumed_tensors = self._done + sum(len(self.journal.partial.get(s.filename) or {}) for _, s in pending)
        self._emit()
        if not pending:
            return
        global _started_here
        started = self._connect()
        if started and _keep_alive:
            _started_here, started = True, False  # `shared_local_ray` shuts it down at the end of its block
        try:
            self._run(pending)
        finally:
            if started:
                ray.shutdown()

    def _connect(self) -> bool:
        """Join or start Ray; True when this call started it (and so must shut it down)."""
        address = self.address or os.environ.get("RAY_ADDRESS")
        if address:
            _check_reachable(address)
        if ray.is_initialized():
            return False
        kwargs: dict[str, Any] = {"address": self.address, "logging_level": logging.WARNING}
        if self.address is None and not os.environ.get("RAY_ADDRESS"):
            kwargs["include_dashboard"] = False  # a throwaway local Ray needs no dashboard
        try:
            ray.init(**kwargs)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            where = self.address or os.environ.get("RAY_ADDRESS") or "a local Ray instance"
            raise MergesmithError(f"cannot start or join Ray at {where}: {_first_line(exc)}") from None
        return True

    def _run(self, pending: list[tuple[int, ShardPlan]]) -> None:
        paths = {ref: _input_path(ck) for ref, ck in self.ckpts.items()}
        plan_ref = ray.put(self.plan)
        kill_once = os.environ.get(KILL_ONCE_ENV) or None
        in_flight: dict[Any, ShardPlan] = {}
        for index, shard in pending:
            task = _write_shard_task.options(
                name=f"mergesmith:{shard.filename}",
                num_cpus=1,
                num_gpus=1 if self.settings.device.startswith("cuda") else 0,
                max_retries=self.max_retries,
                retry_exceptions=False,
            )
            ref = task.remote(
                plan_ref,
                index,
                str(self.out_dir),
                paths,
                self.journal.partial.get(shard.filename),
                self.threads,
                self.settings.max_memory,
                self.settings.device,
                kill_once,
                self.settings.strict,
                self.settings.max_gpu_memory,
            )
            in_flight[ref] = shard
        try:
            while in_flight and not self.stop.is_set():
                ready, _ = ray.wait(list(in_flight), num_returns=1, timeout=0.5)
                for ref in ready:
                    shard = in_flight.pop(ref)
                    self._record(shard, self._result(ref, shard))
        finally:
            if in_flight:  # an error or a stop request
                self._drain(in_flight)
        if self.stop.is_set() and in_flight:
            raise MergeInterrupted(
                f"interrupted: {len(self.journal.finished)} of {len(self.plan.shards)} shards are saved; "
                "run the same command again to resume"
            )

    def _drain(self, in_flight: dict[Any, ShardPlan]) -> None:
        """Stop the remaining tasks and wait until none of them can still write.

        Queued tasks are dropped; running ones are interrupted (KeyboardInterrupt), which lets their
        tensors in flight finish, so no worker is left writing a partial file that a rerun is about to
        reuse. A shard that finishes meanwhile is journaled like any other; a task that does not stop
        within DRAIN_TIMEOUT_S has its worker killed.
        """
        refs = list(in_flight)
        for ref in refs:
            ray.cancel(ref)
        ready, stuck = ray.wait(refs, num_returns=len(refs), timeout=DRAIN_TIMEOUT_S)
        for ref in stuck:
            ray.cancel(ref, force=True)
        if stuck:
            ray.wait(stuck, num_returns=len(stuck), timeout=DRAIN_TIMEOUT_S)
        for ref in ready:
            try:
                record = ray.get(ref)
                self._record(in_flight[ref], record)
            except (ray_exceptions.RayError, MergesmithError):
                continue  # cancelled or failed: the shard is simply not finished
            in_flight.pop(ref)

    def _result(self, ref: Any, shard: ShardPlan) -> dict[str, Any]:
        try:
            return ray.get(ref)
        except ray_exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, BaseException):
                raise cause from exc  # the merge's own error (a bad input, a full disk), as one line
            raise
        except ray_exceptions.RayError as exc:
            raise MergesmithError(
                f"shard {shard.filename}: its Ray task failed after {self.max_retries} retries "
                f"({exc.__class__.__name__}: {_first_line(exc)}); finished shards are saved, rerun to resume"
            ) from None

    def _record(self, shard: ShardPlan, record: dict[str, Any]) -> None:
        """Journal a shard a task finished, once the driver can see it where the worker put it."""
        path = self.out_dir / shard.filename
        if not path.is_file() or path.stat().st_size != record.get("size"):
            raise OutputError(
                f"{path}: a Ray worker wrote this shard but the driver does not see it; the output directory "
                "must be on a filesystem every Ray node shares"
            )
        self.journal.finished[shard.filename] = record
        self.journal.partial.pop(shard.filename, None)
        self.journal.save()
        self._done += len(shard.recipes)
        self._bytes += shard.data_bytes
        self._emit()

    def _emit(self) -> None:
        if self.on_progress is not None:
            self.on_progress(ProgressEvent(self._done, self._total, self._bytes, None))
