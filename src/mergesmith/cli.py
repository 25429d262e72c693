"""The `mergesmith` command line: argument handling and printing, no logic of its own.

A user mistake prints one line (`error: ...`) and exits 2; an unexpected failure prints one line
too and exits 1, with the traceback only under `-v`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import click

from .errors import ConfigError, MergesmithError
from .runtime.process_tuning import (
    exit_code_of,
    exit_now,
    freeze_long_lived_objects,
    prefer_huge_pages,
    thaw_objects,
)

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtKMGT]?)(i?)([bB]?)\s*$")
_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(text: str | int, option: str) -> int:
    """`5B`/`5G`/`500M`/`8GB` are decimal (5B = 5 billion bytes, as mergekit reads it); `8GiB` binary."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ConfigError(f"`{option}`: cannot read size {text!r} (examples: 5B, 500M, 2G, 8GB, 16GiB)")
    number, unit, binary, b = m.groups()
    unit = unit.lower()
    if binary and not unit:
        raise ConfigError(f"`{option}`: cannot read size {text!r} (examples: 5B, 500M, 2G, 8GB, 16GiB)")
    if unit == "" and b:  # "5B" or "5b": billions, mergekit's spelling for shard sizes
        size = int(float(number) * 1e9)
    else:
        size = int(float(number) * (1024 if binary else 1000) ** _UNITS[unit])
    if size <= 0:
        raise ConfigError(f"`{option}`: size must be positive, got {text!r}")
    return size


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mergesmith")
def cli() -> None:
    """Merge language-model checkpoints (mergekit configs, streamed, resumable)."""


_NO_EFFECT_ON_RAW = (
    "--copy-tokenizer/--no-copy-tokenizer",
    "--write-model-card/--no-write-model-card",
    "--trust-remote-code",
)


def _merge_options(f: Any, hide: tuple[str, ...] = ()) -> Any:
    """The options every merging command shares; those in `hide` are still accepted but left out of --help."""

    def option(*decls: str, **attrs: Any) -> Any:
        return click.option(*decls, hidden=decls[0] in hide, **attrs)

    opts = [
        option(
            "--out-shard-size",
            default="5B",
            show_default=True,
            help="Bytes of tensor data per output shard: 5B, 500M, 2G...",
        ),
        option("--random-seed", type=int, default=None, help="Seed for randomised methods (DARE, DELLA)."),
        option(
            "--copy-tokenizer/--no-copy-tokenizer",
            default=True,
            show_default=True,
            help="Copy the tokenizer (from the base model or tokenizer_source).",
        ),
        option(
            "--write-model-card/--no-write-model-card",
            default=True,
            show_default=True,
            help="Write a README.md model card naming the method and the models merged.",
        ),
        option("--allow-crimes", is_flag=True, help="Merge models of different architectures."),
        option(
            "--clone-tensors",
            is_flag=True,
            help="Accepted for mergekit compatibility; has no effect (every tensor is always written "
            "as its own bytes).",
        ),
        option(
            "--lazy-unpickle",
            is_flag=True,
            help="Accepted for mergekit compatibility; has no effect (inputs are always read lazily).",
        ),
        option("--trust-remote-code", is_flag=True, help="Allow model code from checkpoints (off by default)."),
        option(
            "--strict",
            is_flag=True,
            help="Treat every warning as an error: an unknown key or a parameter the method does not use (which "
            "mergekit ignores), a suspicious parameter value, NaN/inf in the inputs, a plan's warnings.",
        ),
        option(
            "--device",
            type=click.Choice(["cpu", "cuda", "mps", "auto"]),
            default="cpu",
            show_default=True,
            help="Where the merge arithmetic runs.",
        ),
        option("--cuda", is_flag=True, help="Same as --device cuda."),
        option(
            "--threads", type=click.IntRange(1, 256), default=None, help="Worker threads (default: number of cores)."
        ),
        option("--max-memory", default=None, help="Bound on bytes in flight, e.g. 8GB."),
        option(
            "--executor",
            type=click.Choice(["local", "ray"]),
            default="local",
            show_default=True,
            help="local: a thread pool here; ray: one Ray task per output shard (needs `pip install mergesmith[ray]` "
            "and OUT_DIR and the inputs on a filesystem every node shares).",
        ),
        option(
            "--ray-address",
            default=None,
            help="Ray cluster to join (`auto`, `HOST:6379`, `ray://HOST:10001`); default: RAY_ADDRESS or a local Ray.",
        ),
        option("-v", "--verbose", is_flag=True, help="Show tracebacks and details."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def _set_cache(_ctx: click.Context, _param: click.Parameter, value: Path | None) -> Path | None:
    from .io import hub

    hub.configure(cache_dir=value)
    return value


def _set_offline(_ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    from .io import hub

    hub.configure(offline=value)
    return value


def _hub_options(f: Any) -> Any:
    """Where hub models are cached and whether they may be downloaded: options of every command that reads
    models. They set io.hub's process-wide settings as they are parsed, so no command passes them on."""
    f = click.option(
        "--offline",
        is_flag=True,
        expose_value=False,
        callback=_set_offline,
        help="Never download: a hub id must already be in the cache (as HF_HUB_OFFLINE=1).",
    )(f)
    return click.option(
        "--transformers-cache",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        expose_value=False,
        callback=_set_cache,
        help="Where hub models are looked up and downloaded (default: the Hugging Face cache, HF_HUB_CACHE).",
    )(f)


def _raw_merge_options(f: Any) -> Any:
    """merge-raw writes no tokenizer, model card or config.json, so those options are hidden there."""
    return _merge_options(f, hide=_NO_EFFECT_ON_RAW)


def _options(kw: dict[str, Any]):
    from .engine.planning import MergeOptions

    executor = kw.get("executor") or "local"
    if kw.get("ray_address") and executor != "ray":
        raise ConfigError("`--ray-address` only applies to the Ray executor: add `--executor ray`")
    from .runtime.devices import resolve_device

    device = "cuda" if kw.get("cuda") else kw.get("device", "cpu")
    # Ray workers, not this driver, need the device
    device = resolve_device(device, check=executor != "ray", what="--device")
    if executor == "ray":
        from .engine.ray_executor import RayExecutor  # noqa: F401 - fail before planning when Ray is not installed
    return MergeOptions(
        out_shard_size=parse_size(kw["out_shard_size"], "--out-shard-size"),
        random_seed=kw.get("random_seed"),
        copy_tokenizer=kw.get("copy_tokenizer", True),
        write_model_card=kw.get("write_model_card", True),
        allow_crimes=kw.get("allow_crimes", False),
        trust_remote_code=kw.get("trust_remote_code", False),
        threads=kw.get("threads") or (os.cpu_count() or 1),
        max_memory=parse_size(kw["max_memory"], "--max-memory") if kw.get("max_memory") else None,
        device=device,
        executor=executor,
        ray_address=kw.get("ray_address"),
        strict=bool(kw.get("strict")),
    )


class _Interrupts:
    """First Ctrl-C asks the merge to stop after the tensors in flight; a second one exits at once."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self._previous: Any = None

    def __enter__(self) -> _Interrupts:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, _signum: int, _frame: Any) -> None:
        if self.stop.is_set():
            _quit_at_once(_signum, _frame)
        self.stop.set()
        click.echo("\nstopping after the tensors in flight (Ctrl-C again to quit at once)...", err=True)

    def __exit__(self, *exc: Any) -> None:
        if self._previous is None:
            return
        if self.stop.is_set():
            # Shutdown after a stop (joining threads, atexit callbacks) can take a while; a Ctrl-C
            # there must quit at once, not print a KeyboardInterrupt traceback from an atexit hook.
            signal.signal(signal.SIGINT, _quit_at_once)
        else:
            signal.signal(signal.SIGINT, self._previous)


def _quit_at_once(_signum: int, _frame: Any) -> None:
    try:
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - a half-written line must not keep us from exiting
        pass
    os.write(2, b"\ninterrupted again: quitting at once\n")
    os._exit(130)


PROGRESS_INTERVAL_ENV = "MERGESMITH_PROGRESS_INTERVAL"


def _progress_interval() -> float:
    try:
        value = float(os.environ.get(PROGRESS_INTERVAL_ENV, "30"))
    except ValueError:
        return 30.0
    return value if value > 0 else 30.0


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class _PlainProgress:
    """Off a terminal (a pipe, a log file, a notebook's `!mergesmith`): a plain line on stderr every
    `interval` seconds (tensors done/total, MB/s, RSS, ETA), since a redrawn bar cannot work there.
    A merge that ends (or fails) before the first interval prints nothing."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._total_bytes = 0
        self._event: Any = None
        self._base: tuple[float, int] | None = None  # (time, bytes) of the first event: a resume starts there
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> _PlainProgress:
        return self

    def start(self, plan: Any) -> None:
        self.close()
        self._total_bytes = plan.total_size
        self._event, self._base = None, None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mergesmith-progress", daemon=True)
        self._thread.start()

    def update(self, event: Any) -> None:
        with self._lock:
            if self._base is None:
                self._base = (time.monotonic(), event.bytes_written)
            self._event = event

    def _run(self) -> None:
        while not self._done.wait(self.interval):
            line = self.line()
            if line:
                click.echo(line, err=True)

    def line(self) -> str | None:
        import psutil

        with self._lock:
            event, base = self._event, self._base
        if event is None or base is None:
            return None
        elapsed = time.monotonic() - base[0]
        rate = (event.bytes_written - base[1]) / elapsed if elapsed > 0 else 0.0
        left = max(self._total_bytes - event.bytes_written, 0)
        eta = _clock(left / rate) if rate > 0 else "unknown"
        rss = psutil.Process().memory_info().rss
        return (
            f"progress: {event.tensors_done}/{event.tensors_total} tensors, {rate / 1e6:.1f} MB/s, "
            f"RSS {rss / 1e9:.2f} GB, ETA {eta}"
        )

    def close(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._thread = None

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _merge_progress(quiet: bool) -> Any:
    """The live bar on a terminal, plain periodic lines elsewhere, nothing with -q."""
    from .display.terminal import MergeProgress

    display = MergeProgress(enabled=not quiet)
    if quiet or display.enabled:
        return display
    return _PlainProgress(_progress_interval())


def _warn_then(quiet: bool, start: Any, prefix: str = "") -> Any:
    """An `on_plan` callback that prints the plan's warnings on stderr (none with -q), then calls `start`."""

    def on_plan(plan: Any) -> None:
        freeze_long_lived_objects()  # the plan is built: what is alive now lives until the end
        if not quiet:
            for warning in plan.warnings:
                click.echo(f"{prefix}warning: {warning}", err=True)
        start(plan)

    return on_plan


_verify_option = click.option(
    "--verify",
    is_flag=True,
    help="Checksum every shard of a complete output instead of trusting its unchanged size and mtime.",
)


def _output_options(
    overwrite_help: str = "Replace a different merge already in OUT_DIR.", verify: bool = True
) -> Callable[[Any], Any]:
    """The options of every command that writes a model into OUT_DIR: --overwrite, --force, --quiet and
    (where a rerun may trust a complete output) --verify, in that order in --help."""

    def apply(command: Any) -> Any:
        if verify:
            command = _verify_option(command)
        command = click.option("--quiet", "-q", is_flag=True, help="No progress display.")(command)
        command = click.option("--force", is_flag=True, help="Start even if the disk looks too small.")(command)
        return click.option("--overwrite", is_flag=True, help=overwrite_help)(command)

    return apply


def _run_shown(run: Callable[..., Any], quiet: bool, *args: Any, **kwargs: Any) -> Any:
    """`run(*args, **kwargs)` under the progress display (none with -q) and Ctrl-C handling every command that
    writes a model uses: the plan's warnings first, then the bar; an interrupt stops at a resumable point."""
    with _Interrupts() as interrupts, _merge_progress(quiet) as progress:
        on_plan = _warn_then(quiet, progress.start)
        return run(*args, on_plan=on_plan, on_progress=progress.update, stop=interrupts.stop, **kwargs)


@cli.command(short_help="Merge a mergekit config into OUT_DIR (resumable).")
@click.argument("config_file", type=click.Path(path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
@_hub_options
@_merge_options
@_output_options()
def merge(config_file: Path, out_dir: Path, overwrite: bool, force: bool, quiet: bool, verify: bool, **kw: Any) -> None:
    """Merge the models of CONFIG_FILE into OUT_DIR (rerun to resume an interrupted merge)."""
    from .runtime import import_manifest
    from .runtime.warm_start import read_ahead_inputs

    import_manifest.read_ahead()  # the files the imports below will read, as the last merge recorded them
    read_ahead_inputs(config_file, out_dir)  # before the heavy imports below
    from .engine.run import run_merge
    from .moe.config import is_moe_config_file

    if is_moe_config_file(config_file):
        raise ConfigError(f"{config_file}: this is a mergekit-moe config (it has `experts`); use `mergesmith moe`")
    options = _options(kw)
    result = _run_shown(
        run_merge, quiet, config_file, out_dir, options, overwrite=overwrite, force=force, verify=verify
    )
    import_manifest.record()  # for the next merge's start
    _report_result(out_dir, result, quiet=quiet)


@cli.command("plan", short_help="Show what a merge will do and cost, from headers.")
@click.argument("config_file", type=click.Path(path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path), required=False)
@_hub_options
@_merge_options
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option("--tensors/--no-tensors", default=False, help="List every output tensor.")
def plan_cmd(config_file: Path, out_dir: Path | None, as_json: bool, tensors: bool, **kw: Any) -> None:
    """Show what a merge will do and cost, reading headers only (no tensor data).

    A mergekit-moe config (one with `experts` and no `merge_method`) is planned as an MoE assembly;
    its router weights are not computed here.
    """
    from .engine.downloads import plan_before_download, render_downloads
    from .engine.report import check_plan_out_dir, plan_report, render_plan_text
    from .engine.run import build_plan
    from .moe.config import is_moe_config_file

    if out_dir is not None:
        check_plan_out_dir(out_dir)
    options = _options(kw)
    moe_file = is_moe_config_file(config_file)

    def build() -> Any:
        if moe_file:
            from .moe import build_moe_plan

            plan, checkpoints, _gates = build_moe_plan(config_file, options, out_dir)
            return plan, checkpoints
        return build_plan(config_file, options, out_dir)

    plan, checkpoints, downloads = plan_before_download(_config_refs(config_file, options), build, out_dir)
    if plan is None:  # a model's tensors cannot be listed before it is downloaded: the downloads alone
        click.echo(json.dumps({"downloads": downloads}, indent=2) if as_json else render_downloads(downloads))
        return
    report = plan_report(plan, checkpoints, out_dir, options)
    if downloads:
        report["downloads"] = downloads
    moe = plan.options.get("moe")
    if moe:
        report["method"] = "moe"
        report["moe"] = moe
    transplant = plan.options.get("tokensurgeon")  # `tokenizer_source: transplant:<donor>`
    if transplant:
        report["tokensurgeon"] = transplant
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(render_plan_text(report, show_tensors=tensors))
        if transplant:
            from .tokensurgeon.planner import describe_counts

            click.echo(
                f"tokenizer: transplant:{transplant['donor']} (the donor's {transplant['vocab_size']} tokens; "
                f"{describe_counts(transplant['tensors'])}; approximated by OMP)"
            )
        if moe:
            click.echo(
                f"moe: {moe['architecture']}, {moe['experts']} experts, {moe['experts_per_token']} per token, "
                f"{moe['shared_experts']} shared; gate_mode {moe['gate_mode']} (router weights are computed by "
                "`mergesmith moe`)"
            )
        if downloads:
            click.echo(render_downloads(downloads))


def _config_refs(config_file: Path, options: Any) -> list[str]:
    """The models a merge or mergekit-moe config names (for the hub models `plan` must look up first)."""
    from .moe.config import is_moe_config_file

    if is_moe_config_file(config_file):
        from .moe.config import load_moe_config

        return load_moe_config(config_file, strict=options.strict).referenced_models()
    from .config import load_config

    return load_config(config_file, strict=options.strict).referenced_models()


@cli.command("merge-raw", short_help="Merge bare state dicts (no config.json) into OUT_DIR.")
@click.argument("config_file", type=click.Path(path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
@_hub_options
@_raw_merge_options
@click.option(
    "--tensor-union", "-u", is_flag=True, help="Merge a tensor some models lack from the models that have it."
)
@click.option("--tensor-intersection", "-i", is_flag=True, help="Leave out tensors that some models lack.")
@_output_options()
def merge_raw(
    config_file: Path,
    out_dir: Path,
    tensor_union: bool,
    tensor_intersection: bool,
    overwrite: bool,
    force: bool,
    quiet: bool,
    verify: bool,
    **kw: Any,
) -> None:
    """Merge bare PyTorch state dicts (.safetensors, .pt, .bin; no config.json) into OUT_DIR.

    CONFIG_FILE is a merge config with `models` (file paths) and no `slices`; OUT_DIR receives
    model.safetensors (or shards and an index) and mergesmith_config.yml.
    """
    from .raw.merge import run_raw_merge

    _refuse_moe_config(config_file)
    if tensor_union and tensor_intersection:
        raise ConfigError("give --tensor-union or --tensor-intersection, not both")
    options = _options(kw)
    tensor_set = "union" if tensor_union else "intersection" if tensor_intersection else "exact"
    result = _run_shown(
        run_raw_merge, quiet, config_file, out_dir, options, tensor_set=tensor_set, overwrite=overwrite, force=force,
        verify=verify,
    )
    _report_result(out_dir, result)


def _refuse_moe_config(config_file: Path) -> None:
    """A mergekit-moe config (or one document of a multi-stage file that is one) belongs to `mergesmith moe`."""
    from .config import read_yaml
    from .moe.config import looks_like_moe

    try:
        documents, _text = read_yaml(config_file, all_documents=True)
    except ConfigError:
        return  # unreadable or malformed: the command itself reports it
    moe = [i for i, doc in enumerate(documents, start=1) if looks_like_moe(doc)]
    if moe:
        which = f" (document {moe[0]})" if len(documents) > 1 else ""
        raise ConfigError(
            f"{config_file}: this is a mergekit-moe config{which} (it has `experts`); use `mergesmith moe`"
        )


def _print_merge_warnings(result: Any, quiet: bool, prefix: str = "") -> None:
    """What the merge found while running (NaN/inf in inputs or output), as the plan's warnings are printed."""
    if not quiet:
        for warning in getattr(result, "warnings", ()):
            click.echo(f"{prefix}warning: {warning}", err=True)


def _report_result(out_dir: Path, result: Any, prefix: str = "", quiet: bool = False) -> None:
    """What the merge found while running (not with `quiet`), then where it wrote and what."""
    _print_merge_warnings(result, quiet, prefix)
    plan = result.plan
    if result.already_complete:
        click.echo(f"{prefix}{out_dir}: already complete (same config and inputs); nothing to do")
        return
    seed = f", random seed {plan.random_seed}" if plan.random_seed is not None else ""
    resumed = f", resumed with {result.shards_reused} finished shard(s)" if result.shards_reused else ""
    click.echo(
        f"{prefix}wrote {out_dir} ({len(plan.recipes)} tensors in {len(plan.shards)} shard(s), "
        f"{_human(plan.total_size)}) in {result.seconds:.1f}s{seed}{resumed}"
    )


class _StageProgress:
    """One progress display per stage that does work; a stage that is already complete shows none."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._plan: Any = None
        self._display: Any = None

    def start(self, plan: Any) -> None:
        self.close()
        self._plan = plan

    def update(self, event: Any) -> None:
        if self._display is None and self._plan is not None and self.enabled:
            self._display = _merge_progress(quiet=False).__enter__()
            self._display.start(self._plan)
        if self._display is not None:
            self._display.update(event)

    def close(self) -> None:
        if self._display is not None:
            self._display.__exit__(None, None, None)
        self._display = None
        self._plan = None


@cli.command("multi", short_help="Run a multi-stage merge file (documents split by ---).")
@click.argument("config_file", type=click.Path(path_type=Path))
@click.option(
    "--out-dir",
    "--intermediate-dir",
    "out_dir",
    type=click.Path(path_type=Path),
    required=True,
    help="Directory that receives each named stage as OUT_DIR/<name>.",
)
@click.option(
    "--out-path", type=click.Path(path_type=Path), default=None, help="Output of the unnamed final merge, if any."
)
@_hub_options
@_merge_options
@click.option(
    "--lazy/--no-lazy",
    default=True,
    show_default=True,
    help="Skip stages whose output is complete for the same config and inputs.",
)
@_output_options("Replace model files in stage directories mergesmith did not write.")
def multi_cmd(
    config_file: Path,
    out_dir: Path,
    out_path: Path | None,
    lazy: bool,
    overwrite: bool,
    force: bool,
    quiet: bool,
    verify: bool,
    **kw: Any,
) -> None:
    """Run a multi-stage file (merge documents separated by `---`, each with a `name`) in dependency order.

    A later document names an earlier one's `name` as a model; each stage is written to OUT_DIR/<name>,
    and a stage whose output is complete for the same config and inputs is skipped.
    """
    from .multi.stages import run_multi

    _refuse_moe_config(config_file)
    options = _options(kw)
    progress = _StageProgress(enabled=not quiet)

    def on_stage(stage: Any, target: Path) -> None:
        progress.close()
        if not quiet:
            click.echo(f"{stage.label} -> {target}", err=True)

    with _Interrupts() as interrupts:
        try:
            results = run_multi(
                config_file,
                out_dir,
                options,
                out_path=out_path,
                lazy=lazy,
                overwrite=overwrite,
                force=force,
                verify=verify,
                on_stage=on_stage,
                on_plan=_warn_then(quiet, progress.start),
                on_progress=progress.update,
                stop=interrupts.stop,
            )
        finally:
            progress.close()
    for r in results:
        _report_result(r.out_dir, r.result, prefix=f"{r.name or '(final)'}: ")


@cli.command("moe", short_help="Build a mixture of experts from dense models.")
@click.argument("config_file", type=click.Path(path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
@_hub_options
@_merge_options
@click.option(
    "--i-understand-this-is-not-useful-without-training",
    "allow_all_same",
    is_flag=True,
    help="Allow every expert to be the same model with prompt-based gates (mergekit-moe's flag).",
)
@click.option("--load-in-4bit", is_flag=True, hidden=True)
@click.option("--load-in-8bit", is_flag=True, hidden=True)
@_output_options(verify=False)
def moe_cmd(
    config_file: Path,
    out_dir: Path,
    allow_all_same: bool,
    load_in_4bit: bool,
    load_in_8bit: bool,
    overwrite: bool,
    force: bool,
    quiet: bool,
    **kw: Any,
) -> None:
    """Assemble a mixture of experts from dense models (a mergekit-moe CONFIG_FILE) into OUT_DIR.

    Attention and norms come from `base_model`, each layer's experts from the `experts` models'
    MLPs; router weights from gate_mode (hidden, cheap_embed, random, uniform_random). Rerun to
    resume an interrupted run.
    """
    from .moe import run_moe
    from .moe.progress import RouterProgress

    if load_in_4bit or load_in_8bit:
        raise ConfigError(
            "`--load-in-4bit`/`--load-in-8bit` are not supported: gate_mode hidden runs the base model in its "
            "own dtype (use --device cuda to move it off the CPU)"
        )
    options = _options(kw)

    def warn(message: str) -> None:
        click.echo(f"warning: {message}", err=True)

    with _Interrupts() as interrupts, RouterProgress("router weights", enabled=not quiet) as router:
        with _merge_progress(quiet) as progress:

            def start(plan: Any) -> None:
                router.close()  # the router pass is over once writing starts
                progress.start(plan)

            result = run_moe(
                config_file,
                out_dir,
                options,
                overwrite=overwrite,
                force=force,
                allow_all_same=allow_all_same,
                on_plan=start,
                on_progress=progress.update,
                on_gate_progress=router.update,
                on_warning=warn,
                stop=interrupts.stop,
            )
    plan = result.plan
    if result.already_complete:
        click.echo(f"{out_dir}: already complete (same config and inputs); nothing to do")
        return
    moe = plan.options["moe"]
    seed = f", random seed {plan.random_seed}" if plan.random_seed is not None else ""
    resumed = f", resumed with {result.shards_reused} finished shard(s)" if result.shards_reused else ""
    click.echo(
        f"wrote {out_dir} ({moe['architecture']}, {moe['experts']} experts, {moe['experts_per_token']} per token; "
        f"{len(plan.recipes)} tensors in {len(plan.shards)} shard(s), {_human(plan.total_size)}) "
        f"in {result.seconds:.1f}s{seed}{resumed}"
    )


@cli.command("extract-lora", short_help="Extract a LoRA adapter approximating MODEL - BASE.")
@click.option("--model", required=True, help="The fine-tuned model (path, hub id, or model+lora).")
@click.option("--base", "--base-model", "base", required=True, help="The model it was fine-tuned from.")
@click.option("--out", "--out-path", "out", required=True, type=click.Path(path_type=Path), help="Adapter directory.")
@click.option("--max-rank", type=click.IntRange(min=1), default=128, show_default=True, help="Largest LoRA rank.")
@click.option("--sv-epsilon", type=float, default=0.0, show_default=True, help="Drop singular values at or below.")
@click.option("--embed-lora", is_flag=True, help="Factor the embedding and lm_head too (default: save them whole).")
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda", "mps"]),
    default="cpu",
    show_default=True,
    help="Where the SVDs run.",
)
@click.option("--overwrite", is_flag=True, help="Replace an adapter already in --out.")
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks and details.")
@_hub_options
def extract_lora_cmd(
    model: str,
    base: str,
    out: Path,
    max_rank: int,
    sv_epsilon: float,
    embed_lora: bool,
    device: str,
    overwrite: bool,
    verbose: bool,
) -> None:
    """Write a PEFT LoRA adapter approximating MODEL - BASE (truncated SVD per linear weight)."""
    from .lora.extract import extract_lora
    from .runtime.devices import resolve_device

    device = resolve_device(device, what="--device")

    result = extract_lora(
        model,
        base,
        out,
        max_rank,
        sv_epsilon=sv_epsilon,
        embed_lora=embed_lora,
        device=device,
        overwrite=overwrite,
        on_module=(lambda m: click.echo(f"  {m}", err=True)) if verbose else None,
    )
    for note in result.notes:
        click.echo(f"note: {note}", err=True)
    top = max(result.ranks.values(), default=0)
    click.echo(
        f"wrote {out} ({len(result.ranks)} low-rank modules, rank <= {top}; "
        f"{len(result.modules_to_save)} modules saved whole) in {result.seconds:.1f}s"
    )


# ----- tokensurgeon (issue 20): one command, all logic in tokensurgeon/ ---------------------------
_MATCH = click.Choice(["no", "yes", "embed", "lm_head"])


@cli.command("tokensurgeon", short_help="Give a model another model's tokenizer (training-free).")
@click.argument("base")
@click.argument("donor")
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option(
    "--approximation-method",
    "-a",
    type=click.Choice(["omp", "common_interpolation", "subword", "mean", "zero", "randn"]),
    default="omp",
    show_default=True,
    help="How rows of tokens BASE lacks are made.",
)
@click.option("--k", "-k", type=int, default=64, show_default=True, help="Shared tokens per approximation.")
@click.option("--prefix-match", "-pm", type=_MATCH, default="no", is_flag=False, flag_value="yes", show_default=True,
              help="Use BASE's row of a token's longest prefix (bare flag: yes).")
@click.option("--byte-match", "-bm", type=_MATCH, default="no", is_flag=False, flag_value="yes", show_default=True,
              help="Match single characters with <0xNN> byte tokens (bare flag: yes).")
@click.option("--weight-scheme", "-w", type=click.Choice(["distance_proportional", "barycentric", "least_squares"]),
              default="distance_proportional", show_default=True, help="Weights for common_interpolation.")
@click.option("--cosine-similarity/--no-cosine-similarity", "-c/-nc", default=False,
              help="Cosine distance for common_interpolation's neighbours.")
@click.option("--subword-method", "-s", type=click.Choice(["mean", "sum", "weighted_mean", "first_last"]),
              default="mean", show_default=True, help="How subword combines a token's pieces.")
@click.option("--batch-size", type=int, default=None, help="Tokens approximated at once (default: by memory).")
@click.option("--new-vocab-noise", "-nvn", type=float, default=None, help="Gaussian noise added to new rows.")
@click.option("--new-vocab-scale", "-nvs", type=float, default=None, help="Scale applied to new rows.")
@click.option("--magikarp/--no-magikarp", default=False, hidden=True)
@_hub_options
@_merge_options
@_output_options("Replace a different model already in OUT_DIR.", verify=False)
def tokensurgeon_cmd(base: str, donor: str, out_dir: Path, magikarp: bool, overwrite: bool, force: bool,
                     quiet: bool, **kw: Any) -> None:
    """Write BASE with DONOR's tokenizer into OUT_DIR (mergekit-tokensurgeon's options).

    Tokens both tokenizers have keep BASE's rows exactly; the others are approximated (omp: the k shared
    tokens that best rebuild the donor's embedding of the token, their weights applied to BASE's rows).
    Rerun to resume an interrupted run.
    """
    from .tokensurgeon import SurgeryOptions, run_tokensurgeon
    from .tokensurgeon.planner import describe_counts

    if magikarp:
        raise ConfigError("`--magikarp` is not supported by mergesmith tokensurgeon")
    names = ("approximation_method", "k", "prefix_match", "byte_match", "weight_scheme", "cosine_similarity",
             "subword_method", "batch_size", "new_vocab_noise", "new_vocab_scale")
    surgery = SurgeryOptions(**{n: kw.pop(n) for n in names})
    options = _options(kw)
    result, counts = _run_shown(
        run_tokensurgeon, quiet, base, donor, out_dir, surgery, options, overwrite=overwrite, force=force
    )
    if result.already_complete:
        click.echo(f"{out_dir}: already complete (same inputs and options); nothing to do")
        return
    summary = result.plan.options["tokensurgeon"]
    click.echo(
        f"wrote {out_dir} (vocabulary {summary['vocab_size']}, {surgery.approximation_method}; "
        f"{describe_counts(counts)}) in {result.seconds:.1f}s"
    )

@cli.command("evolve", short_help="Search merge parameters with CMA-ES (mergekit-evolve genomes).")
@click.argument("genome_file", type=click.Path(path_type=Path))
@click.option(
    "--storage-path", required=True, type=click.Path(path_type=Path), help="Journal, history, best config."
)
@click.option("--max-fevals", type=click.IntRange(min=1), default=100, show_default=True, help="Evaluations.")
@click.option("--sigma0", type=float, default=1 / 6, show_default=True, help="Initial CMA-ES step size.")
@click.option("--random-seed", type=int, default=0, show_default=True, help="Seed (same seed, same history).")
@click.option("--popsize", type=click.IntRange(min=2), default=None, help="Candidates per generation.")
@click.option("--batch-size", type=click.IntRange(min=1), default=32, show_default=True, help="Evaluation batch size.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Score each task on its first N records.")
@click.option("--num-fewshot", type=click.IntRange(min=0), default=None, help="Few-shot examples (lm-eval tasks).")
@click.option("--task-search-path", multiple=True, help="Directory of lm-eval task YAMLs (lm-eval tasks only).")
@click.option("--lm-eval-arg", multiple=True, metavar="KEY=VALUE",
              help="Passed to lm-eval's simple_evaluate (e.g. fewshot_random_seed=1); repeatable.")
@click.option("--in-memory/--no-in-memory", default=None, help="Merge candidates in memory (default: when they fit).")
@click.option("--merge-cuda/--no-merge-cuda", default=False, help="Do the merge arithmetic on the GPU.")
@click.option("--device", type=click.Choice(["cpu", "cuda", "auto"]), default="cpu", show_default=True,
              help="Where candidates are evaluated.")
@click.option("--dtype", default="bfloat16", show_default=True, help="Candidates' dtype (mergekit-evolve: bfloat16).")
@click.option("--threads", type=click.IntRange(1, 256), default=None, help="Torch threads (default: 1, tiny models).")
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="ray: a generation's candidates are scored as Ray tasks.")
@click.option("--ray-address", default=None, help="Ray cluster to join (default: RAY_ADDRESS or a local Ray).")
@click.option("--vllm/--no-vllm", default=False, hidden=True)
@click.option("--merge-best", type=click.Path(path_type=Path), default=None, help="Write the best merge here.")
@click.option("--overwrite", is_flag=True, help="Start over when the storage path holds a different search.")
@click.option("--trust-remote-code", is_flag=True, help="Allow model code from checkpoints.")
@click.option("--allow-crimes", is_flag=True, help="Merge models of different architectures.")
@click.option("--quiet", "-q", is_flag=True, help="Only the summary.")
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks and details.")
@_hub_options
def evolve_cmd(genome_file: Path, storage_path: Path, **kw: Any) -> None:
    """Find merge parameters for GENOME_FILE (mergekit-evolve's format) by CMA-ES; resumable: rerun to continue."""
    from .evolve.command import run_evolve_command

    run_evolve_command(genome_file, storage_path, kw)


def _show_downloads(quiet: bool) -> None:
    """Downloads of hub models: huggingface_hub's bars on a terminal, one line per file elsewhere, and a line
    naming the model either way; nothing with -q."""
    from .io import hub

    hub.configure(
        cache_dir=None,
        offline=False,
        progress_bars=not quiet and hub.stderr_is_terminal(),
        report=None if quiet else (lambda line: click.echo(line, err=True)),
    )


_NoArgsIsHelp = getattr(click.exceptions, "NoArgsIsHelpError", None)  # click >= 8.2


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the CLI, turning errors into one line and an exit code."""
    args = sys.argv[1:] if argv is None else argv
    prefer_huge_pages()  # before any command imports torch
    verbose = "-v" in args or "--verbose" in args
    _show_downloads(quiet="-q" in args or "--quiet" in args)
    try:
        try:
            cli.main(args=args, prog_name="mergesmith", standalone_mode=False)
        finally:
            thaw_objects()
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.UsageError as exc:
        if _NoArgsIsHelp is not None and isinstance(exc, _NoArgsIsHelp):
            # `mergesmith` alone: the help is the answer, not an error
            click.echo(exc.format_message(), err=True)
            sys.exit(exc.exit_code)
        # one line, like every other user error; `--help` has the full usage
        where = f" (see `{exc.ctx.command_path} --help`)" if exc.ctx is not None else ""
        message = " ".join(exc.format_message().split())
        click.echo(f"error: {message}{where}", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        click.echo(f"error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except MergesmithError as exc:
        if verbose:
            traceback.print_exc()
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - the last line of defence: one line, details with -v
        if verbose:
            traceback.print_exc()
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        click.echo(f"error: internal error: {exc.__class__.__name__}: {first} (rerun with -v for details)", err=True)
        sys.exit(1)
    sys.exit(0)


def run() -> NoReturn:
    """The console script: `main`, then a quick exit (process_tuning.exit_now), since the command owns
    its process. In-process callers (tests, notebooks) use `main`, which raises SystemExit as usual."""
    try:
        main()
    except SystemExit as exc:
        exit_now(exit_code_of(exc))
    exit_now(0)


if __name__ == "__main__":  # pragma: no cover
    run()
